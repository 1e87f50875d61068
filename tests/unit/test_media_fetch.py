"""Remote image fetch policy decisions that need no server: what is refused before any
connection is made."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mlxd.errors import InvalidRequest
from mlxd.media import MediaPolicy, load_bytes

OPEN_INTERNET = MediaPolicy(allow_remote=True, dirs=(Path("/nowhere"),), max_bytes=1024, timeout=2)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/x.png",
        "http://[::1]:9/x.png",
        "http://10.1.2.3/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fe80::1]/x.png",
        "http://localhost:9/x.png",
    ],
)
def test_private_loopback_and_link_local_are_refused_unless_listed(url: str):
    with pytest.raises(InvalidRequest) as caught:
        load_bytes(url, OPEN_INTERNET, "messages[0].content[0]")
    assert "allowed_media_domains" in caught.value.message
    assert url not in caught.value.message


def test_listing_a_domain_covers_its_subdomains_only():
    policy = MediaPolicy(True, (), 1024, 2, domains=("example.org",))
    assert policy.listed("example.org") and policy.listed("img.example.org")
    assert not policy.listed("badexample.org") and not policy.listed("example.org.evil.test")


class _Echo(BaseHTTPRequestHandler):
    """Answers every GET with the Host header it was sent."""

    def do_GET(self) -> None:
        body = self.headers["Host"].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def test_the_fetch_connects_to_the_address_it_checked(
    echo_port: int, monkeypatch: pytest.MonkeyPatch
):
    """A name only the check's resolution knows (a DNS that answers differently each time
    would look the same to the fetch): the GET goes to the checked address, and the server
    still sees the name in Host."""
    resolve = asyncio.base_events.BaseEventLoop.getaddrinfo
    resolved = []

    async def rebinding_dns(loop, host, port, **kwargs):  # type: ignore[no-untyped-def]
        resolved.append(host)
        if host == "nas.home.invalid":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        return await resolve(loop, host, port, **kwargs)

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", rebinding_dns)
    policy = MediaPolicy(True, (), 1024, 5, domains=("nas.home.invalid",))
    url = f"http://nas.home.invalid:{echo_port}/cat.png"
    assert load_bytes(url, policy, "image") == f"nas.home.invalid:{echo_port}".encode()
    assert resolved == ["nas.home.invalid"]  # once, by the check; never by the connection
