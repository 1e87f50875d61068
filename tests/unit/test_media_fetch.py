"""Remote image fetch policy decisions that need no server: what is refused before any
connection is made."""

from __future__ import annotations

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
