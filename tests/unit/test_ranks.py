"""The daemon's side of a distributed model's ranks, before any rank starts."""

from __future__ import annotations

import asyncio

import pytest

from mlxd.config import DistributedConfig
from mlxd.distributed.launch import LaunchError
from mlxd.runtime.rank_group import RankGroup


def test_rank_0_elsewhere_is_refused_before_anything_starts():
    block = DistributedConfig(hosts=["192.0.2.7", "127.0.0.1"], strategy="pipeline")
    with pytest.raises(LaunchError, match=r"'192\.0\.2\.7' is not this machine"):
        asyncio.run(RankGroup.launch("far", block))
