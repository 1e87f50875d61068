"""Remote images (`server.allow_remote_media`) without SSRF, against the real daemon and a
real HTTP server on loopback: only listed hosts, every redirect hop checked, private and
loopback addresses refused unless listed, one deadline per fetch, errors that tell nothing
about the network."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import openai
import pytest
from PIL import Image

from tests.integration.daemon import Daemon, start_daemon

pytestmark = pytest.mark.integration

FETCH_TIMEOUT_S = 2


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class ImageServer(BaseHTTPRequestHandler):
    """/ok.png an image; /to-loopback a redirect to 127.0.0.1; /drip one byte at a time."""

    seen: ClassVar[list[str]] = []
    hosts: ClassVar[list[str]] = []
    image = _png()

    def do_GET(self) -> None:
        self.seen.append(self.path)
        self.hosts.append(self.headers["Host"])
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self._send(self.image)
        elif self.path == "/to-loopback":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{port}/ok.png?via=redirect")
            self.end_headers()
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(self.image)))
            self.end_headers()
            for byte in self.image[:60]:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)
        else:
            self.send_error(404, "secret internal page")

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), ImageServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, mlxd_cache_dir: Path, tiny_vlm: Path):
    config = {
        "server": {
            "cache_dir": str(mlxd_cache_dir),
            "allow_remote_media": True,
            # The owner lists `localhost` (their own box); 127.0.0.1 itself is not listed.
            "allowed_media_domains": ["localhost"],
            "media_fetch_timeout": f"{FETCH_TIMEOUT_S}s",
        },
        "models": {
            "vlm": {"kind": "vlm", "source": str(tiny_vlm), "defaults": {"temperature": 0.0}}
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("remote-media"), config)
    yield running
    running.stop()


def ask(daemon: Daemon, url: str) -> str:
    client = openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="none", max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
    reply = client.chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": content}], max_tokens=2
    )
    return reply.choices[0].message.content or ""


def refusal(daemon: Daemon, url: str) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(daemon, url)
    message = caught.value.body["message"]
    assert url not in message and "127.0.0.1" not in message and "404" not in message
    return message


def test_a_listed_host_is_fetched(daemon: Daemon, image_server: int):
    ImageServer.hosts.clear()
    ask(daemon, f"http://localhost:{image_server}/ok.png")
    assert "/ok.png" in ImageServer.seen
    # Connected to the address the check resolved, but asked by name.
    assert ImageServer.hosts == [f"localhost:{image_server}"]


def test_a_redirect_to_an_unlisted_loopback_address_is_refused(daemon: Daemon, image_server: int):
    ImageServer.seen.clear()
    message = refusal(daemon, f"http://localhost:{image_server}/to-loopback")
    assert "allowed_media_domains" in message
    assert ImageServer.seen == ["/to-loopback"]  # the redirect's target was never asked


def test_unlisted_and_private_hosts_are_refused(daemon: Daemon, image_server: int):
    ImageServer.seen.clear()
    for url in (
        f"http://127.0.0.1:{image_server}/ok.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://192.168.0.1/router.png",
    ):
        assert "allowed_media_domains" in refusal(daemon, url)
    assert ImageServer.seen == []


def test_upstream_errors_say_nothing_of_the_upstream(daemon: Daemon, image_server: int):
    message = refusal(daemon, f"http://localhost:{image_server}/admin")
    assert "secret" not in message and "could not be fetched" in message


def test_a_slow_sender_meets_one_deadline(daemon: Daemon, image_server: int):
    started = time.monotonic()
    message = refusal(daemon, f"http://localhost:{image_server}/drip")
    # The drip takes 30 s; the fetch gives up at its deadline (generous bound for slow CI).
    assert time.monotonic() - started < 25
    assert "media_fetch_timeout" in message
