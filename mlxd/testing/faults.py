"""Fault injection for tests only, as worker hooks: `MLXD_WORKER_HOOKS=mlxd.testing.faults` and
`MLXD_FAULT_INJECT`, read when a worker starts. Production code never imports this module.

`MLXD_FAULT_INJECT=sequence:MARKER1,thread:MARKER2,load:MODEL`: a request whose prompt contains
a marker gets a logits processor that raises on its AFTER_TOKENS+1-th token. `sequence` raises an
ordinary exception (that request alone must fail); `thread` raises one that nothing on the model
thread catches (the engine thread dies and must be restarted). `load` makes the worker process of
model MODEL abort (SIGABRT) before it loads, every time. Unset, nothing is added.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mlxd.types import GenerationRequest

ENV = "MLXD_FAULT_INJECT"
AFTER_TOKENS = 3


class InjectedThreadDeath(BaseException):
    """Not an `Exception`: it escapes every per-sequence and per-step guard."""


def faults_from_env() -> dict[str, str]:
    """{kind: marker} from the environment; empty when fault injection is off."""
    faults = {}
    for item in os.environ.get(ENV, "").split(","):
        kind, _, marker = item.partition(":")
        if kind in ("sequence", "thread", "load") and marker:
            faults[kind] = marker
    return faults


def fault_processors(faults: dict[str, str], request: GenerationRequest) -> list[Any]:
    if not faults:
        return []
    prompt = json.dumps(request.messages) if request.messages is not None else str(request.prompt)
    for kind, marker in faults.items():
        if kind in ("sequence", "thread") and marker in prompt:
            return [_raising(RuntimeError if kind == "sequence" else InjectedThreadDeath)]
    return []


def _raising(error: type[BaseException]) -> Any:
    calls = 0

    def processor(tokens: Any, logits: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > AFTER_TOKENS:
            raise error(f"injected fault ({ENV})")
        return logits

    return processor


class FaultHooks:
    """`mlxd.worker.hooks.WorkerHooks` that inject the faults `MLXD_FAULT_INJECT` names."""

    def __init__(self) -> None:
        self.faults = faults_from_env()

    def before_load(self, model: str) -> None:
        if self.faults.get("load") == model:
            os.abort()  # a model whose worker dies on every load

    def logits_processors(self, request: GenerationRequest) -> list[Any]:
        return fault_processors(self.faults, request)


def hooks() -> FaultHooks:
    return FaultHooks()
