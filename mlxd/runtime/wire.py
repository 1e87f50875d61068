"""Messages between the daemon and a worker: length-prefixed pickles over a socket pair.

Pickle is safe here only because both ends are the same program and nothing else can connect:
the socket is an anonymous `socketpair()` inherited by the child, or for a distributed model's
rank 0 a unix socket in a private (0700) directory that accepts one connection
(runtime/rank_group.py).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from mlxd.config import ModelConfig, ServerConfig

_HEADER = struct.Struct("!I")


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message; `asyncio.IncompleteReadError` once the other end has gone."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def write_message(writer: asyncio.StreamWriter, message: Any) -> None:
    """Queue `message` on the transport (no await: the other end reads continuously)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    writer.write(_HEADER.pack(len(data)) + data)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to know, sent as its first message."""

    name: str
    config: ModelConfig
    server: ServerConfig

    @classmethod
    def without_keys(cls, name: str, config: ModelConfig, server: ServerConfig) -> WorkerSpec:
        """The spec with every `api_keys` emptied: workers never check a key (the daemon does),
        and a distributed model's rank 0 hands its config on to the other ranks' machines."""
        return cls(
            name,
            config.model_copy(update={"api_keys": []}),
            server.model_copy(update={"api_keys": []}),
        )
