"""Extension points a worker loads by module name from `MLXD_WORKER_HOOKS`.

The test suite injects faults through them (`mlxd.testing.faults`); production sets nothing and
runs no hooks. The worker never names a testing module: it imports whatever the variable says.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Protocol

from mlxd.types import GenerationRequest

ENV = "MLXD_WORKER_HOOKS"


class WorkerHooks(Protocol):
    def before_load(self, model: str) -> None:
        """Runs in the worker before it reads any weights."""

    def logits_processors(self, request: GenerationRequest) -> list[Any]:
        """Extra logits processors for one request (mlx-lm's `(tokens, logits) -> logits`)."""


class NoHooks:
    def before_load(self, model: str) -> None:
        pass

    def logits_processors(self, request: GenerationRequest) -> list[Any]:
        return []


def load_hooks() -> WorkerHooks:
    """The hooks module named by the environment (its `hooks()`), or hooks that do nothing."""
    name = os.environ.get(ENV)
    if not name:
        return NoHooks()
    hooks: WorkerHooks = importlib.import_module(name).hooks()
    return hooks
