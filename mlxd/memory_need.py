"""What a model will hold in memory once loaded, known before any weight is read: the worker
sends it (runtime/wire.py), the daemon admits it against `server.memory_budget`."""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.config import ServerConfig
from mlxd.config.server import DEFAULT_BUDGET_SHARE


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
        unset = (
            f" (unset: {DEFAULT_BUDGET_SHARE:.0%} of the memory this machine or its cgroup allows)"
            if server.memory_budget is None
            else ""
        )
        return (
            f"model '{model}' needs {gib(self.total)} ({self.describe()}) but "
            f"server.memory_budget is {gib(budget)}{unset}: lower batch.max_batch_size, "
            "context_length or cache.ram, or raise server.memory_budget"
        )


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
