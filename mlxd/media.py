"""Images named in chat messages: where they may come from, fetching, decoding, limits.

One internal image part for both dialects: OpenAI's `{"type": "image_url", "image_url":
{"url": ...}}` (Anthropic image blocks are translated into it). A part may carry `param`, the
place the caller wrote it (e.g. `messages[0].content[1]`); error messages name that place.
Sources: `data:` URLs; `http(s)` URLs only with `server.allow_remote_media`; local files
(`file://` URLs or absolute paths) only under `server.media_dirs`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import httpx

from mlxd.config import ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.types import IMAGE_TYPES, OverLimit

if TYPE_CHECKING:
    from PIL.Image import Image

# Decoded size cap for all of a request's images together, read from their headers before any
# is decoded: a 10 KB PNG can expand to hundreds of MB of RGB (decompression bombs).
MAX_PIXELS = 64 * 1024 * 1024
# The formats mlxd decodes; PIL would otherwise try every plugin it has on untrusted bytes.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


MAX_REDIRECTS = 5


@dataclass(frozen=True)
class MediaPolicy:
    allow_remote: bool
    dirs: tuple[Path, ...]
    max_bytes: int
    timeout: float
    # Host names (and their subdomains) or addresses remote images may come from; empty: any
    # public host. Listed ones may also be private (a NAS on the LAN).
    domains: tuple[str, ...] = ()

    @classmethod
    def from_server(cls, server: ServerConfig) -> MediaPolicy:
        return cls(
            allow_remote=server.allow_remote_media,
            dirs=tuple(d.resolve() for d in server.media_dirs),
            max_bytes=int(server.max_image_bytes),
            timeout=float(server.media_fetch_timeout),
            domains=tuple(d.lower().strip(".") for d in server.allowed_media_domains),
        )

    def listed(self, host: str) -> bool:
        return any(host == d or host.endswith(f".{d}") for d in self.domains)


def image_parts(messages: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str]]:
    """Each image part of `messages` in prompt order, with the place it is named by."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") in IMAGE_TYPES:
                yield part, part.get("param") or f"messages[{i}].content[{j}]"


def has_images(messages: list[dict[str, Any]] | None) -> bool:
    return any(True for _ in image_parts(messages or []))


def load_images(messages: list[dict[str, Any]], policy: MediaPolicy) -> list[Image]:
    """The decoded (RGB) images of `messages`; any problem is a 400 naming the part. Their
    sizes are read from the headers first: nothing is decoded unless all of them fit."""
    encoded = [
        (load_bytes(_url(part, param), policy, param), param)
        for part, param in image_parts(messages)
    ]
    pixels = sum(_pixels(data, param) for data, param in encoded)
    if pixels > MAX_PIXELS:
        raise OverLimit("images", f"{pixels} pixels in all; at most {MAX_PIXELS} are accepted")
    return [decode_image(data, param) for data, param in encoded]


def _url(part: dict[str, Any], param: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{param}: image_url.url is missing", param=param)
    return url


def load_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The encoded image `url` names, within the policy."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, policy, param)
    elif scheme in ("http", "https"):
        data = _fetch(url, policy, param)
    elif scheme == "file" or (not scheme and url.startswith("/")):
        data = _local_file(url, policy, param)
    else:
        raise InvalidRequest(
            f"{param}: images must be data:, http(s):, file:// URLs or absolute paths",
            param=param,
        )
    return data


def _pixels(data: bytes, param: str) -> int:
    """The image's width × height from its header (PIL opens lazily: nothing is decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            return image.width * image.height
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{param}: cannot decode the image: {exc}", param=param) from exc


def decode_image(data: bytes, param: str) -> Image:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            if image.width * image.height > MAX_PIXELS:
                raise OverLimit(
                    "images",
                    f"{param} is {image.width}x{image.height} pixels; at most {MAX_PIXELS} "
                    "are accepted",
                )
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequest(f"{param}: cannot decode the image: {exc}", param=param) from exc


def _too_large(param: str, policy: MediaPolicy) -> InvalidRequest:
    return InvalidRequest(
        f"{param}: image is larger than {policy.max_bytes} bytes (server.max_image_bytes)",
        param=param,
    )


def _data_url(url: str, policy: MediaPolicy, param: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidRequest(
            f"{param}: data URLs must be base64 (data:<type>;base64,...)", param=param
        )
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise _too_large(param, policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"{param}: invalid base64 image data: {exc}", param=param) from exc


class _Refused(Exception):
    """A remote image the policy does not allow (its host, an address, a redirect)."""


def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    """A remote image, every redirect hop checked against the policy, within one deadline
    for the whole fetch. Errors say what went wrong in general terms only: the daemon must
    not tell a caller what answers where on its network."""
    if not policy.allow_remote:
        raise InvalidRequest(
            f"{param}: remote images are disabled (server.allow_remote_media)", param=param
        )
    # Blocking callers (the worker's prepare thread), so a loop of its own: asyncio gives a
    # deadline that holds whatever the server does (one byte every few seconds included).
    try:
        return asyncio.run(asyncio.wait_for(_fetch_hops(url, policy, param), policy.timeout))
    except _Refused:
        reason = "its address is not allowed (server.allowed_media_domains)"
    except TimeoutError:
        reason = f"it took longer than {policy.timeout:g} s (server.media_fetch_timeout)"
    except (httpx.HTTPError, OSError, ValueError):
        reason = "it could not be fetched"
    raise InvalidRequest(f"{param}: remote image refused: {reason}", param=param)


async def _fetch_hops(url: str, policy: MediaPolicy, param: str) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target = httpx.URL(url)
            async with _pinned_get(client, target, policy) as response:
                if response.is_redirect:
                    url = str(target.join(response.headers.get("location", "")))
                    continue
                response.raise_for_status()
                chunks, size = [], 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > policy.max_bytes:
                        raise _too_large(param, policy)
                    chunks.append(chunk)
                return b"".join(chunks)
    raise httpx.TooManyRedirects("too many redirects")


@asynccontextmanager
async def _pinned_get(
    client: httpx.AsyncClient, target: httpx.URL, policy: MediaPolicy
) -> AsyncIterator[httpx.Response]:
    """GET `target` from the addresses just checked (the next one if one refuses the
    connection), never from the name: resolving it again could answer differently (DNS
    rebinding). The Host header and TLS (SNI and the certificate) still use the name."""
    headers = {"Host": target.netloc.decode("ascii")}
    sni = {"sni_hostname": target.host} if target.scheme == "https" else {}
    addresses = await _checked_addresses(target, policy)
    for address in addresses:
        pinned = target.copy_with(host=address)
        request = client.build_request("GET", pinned, headers=headers, extensions=sni)
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError:
            if address == addresses[-1]:
                raise
            continue
        try:
            yield response
        finally:
            await response.aclose()
        return


async def _checked_addresses(target: httpx.URL, policy: MediaPolicy) -> list[str]:
    """`target`'s addresses, resolved once: of an http(s) URL to a listed host (any address),
    or, none listed, to a host every address of which is public."""
    host = target.host.lower()
    if target.scheme not in ("http", "https") or not host:
        raise _Refused()
    if policy.domains and not policy.listed(host):
        raise _Refused()
    port = target.port or (443 if target.scheme == "https" else 80)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [str(info[4][0]) for info in infos]
    if not addresses or not all(_address_ok(address, host, policy) for address in addresses):
        raise _Refused()
    return addresses


def _address_ok(address: str, host: str, policy: MediaPolicy) -> bool:
    """A public address, or any address of a host the owner listed."""
    if policy.listed(host.lower()):
        return True
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_global
    except ValueError:
        return False


def _local_file(url: str, policy: MediaPolicy, param: str) -> bytes:
    path = Path(unquote(urlparse(url).path) if url.startswith("file:") else url).resolve()
    if not any(path.is_relative_to(d) for d in policy.dirs):
        raise InvalidRequest(
            f"{param}: {path} is not under a directory listed in server.media_dirs", param=param
        )
    try:
        if path.stat().st_size > policy.max_bytes:
            raise _too_large(param, policy)
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"{param}: cannot read {path}: {exc.strerror}", param=param) from exc
