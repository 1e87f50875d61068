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


@dataclass(frozen=True)
class MemoryNeed:
    """What a model will hold once loaded, by part, known from file headers before any weight
    is read: the worker's `need` message, which the daemon admits against the budget."""

    weights: int  # as they will run (packed, cast or as stored)
    kv: int = 0  # live KV of max_batch_size sequences at the full context
    kv_shape: str = ""  # how `kv` was counted, e.g. "32 sequences x 8192 tokens, float32"
    prefix_cache: int = 0  # cache.ram: the prefix cache's RAM tier
    extra: int = 0  # a speculative draft model, a LoRA adapter

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.prefix_cache + self.extra

    def describe(self) -> str:
        """'0.13 GiB weights + 11.25 GiB KV (32 sequences x 8192 tokens, float32) + …'"""
        parts = [f"{gib(self.weights)} weights"]
        if self.kv:
            parts.append(f"{gib(self.kv)} KV ({self.kv_shape})")
        if self.prefix_cache:
            parts.append(f"{gib(self.prefix_cache)} prefix cache (cache.ram)")
        if self.extra:
            parts.append(f"{gib(self.extra)} draft model and adapter")
        return " + ".join(parts)

    def over_budget(self, model: str, server: ServerConfig) -> str | None:
        """Why model `model` cannot fit server.memory_budget even alone; None when it can."""
        budget = server.budget_bytes
        if self.total <= budget:
            return None
        unset = " (unset: 75% of physical memory)" if server.memory_budget is None else ""
        return (
            f"model '{model}' needs {gib(self.total)} ({self.describe()}) but "
            f"server.memory_budget is {gib(budget)}{unset}: lower batch.max_batch_size, "
            "context_length or cache.ram, or raise server.memory_budget"
        )


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
