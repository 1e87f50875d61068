"""A distributed model's ranks, inside their workers: rank 0 leads, the other ranks follow.

mlx.launch starts `python -m mlxd.worker --connect PATH` on every rank. Rank 0 connects
to the daemon and is the model's worker like any other (worker.py); the other ranks never talk
to the daemon. Every rank holds an `LLMEngine` over its share of the weights, and every rank's
model thread must make the same BatchGenerator calls in the same order, or the collectives inside
the model (all_sum, send/recv) pair up wrongly and hang or mix data.

So rank 0's model thread drives a `LeaderCore`: before each step it broadcasts what its loop
applied since the last one (the sequences added, with their request and prompt ids; aborts), and
a follower's model thread drives a `FollowerCore` that applies exactly those commands to its own
`LLMCore` and takes the same step. Everything `LLMCore.step` decides (admission, stop strings,
finishing) depends only on those commands, the batch settings and the sampled tokens, which are
the same on every rank (the logits are: all_sum and all_gather hand every rank the same values;
the samplers draw from a seed rank 0 shares). Each broadcast also carries rank 0's queue sizes:
a follower whose own differ stops the group (a restart) rather than let it hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.config import ModelConfig, ServerConfig
from mlxd.distributed.broadcast import broadcast_object, gather_object, shared_seed
from mlxd.distributed.shard import load_rank
from mlxd.types import GenerationRequest
from mlxd.worker.llm import LLMEngine
from mlxd.worker.llm_core import LLMCore
from mlxd.worker.sequence import Output, Sequence

log = logging.getLogger("mlxd.worker")

WATCH_S = 0.1
# A follower's exit status when its model thread died or it diverged from rank 0.
EXIT_FOLLOWER_FAILED = 3

# One command from rank 0: ("add", key, request, prompt_ids) | ("abort", key)
# | ("step", waiting, running) | ("stop",)
Command = tuple[Any, ...]


class LeaderCore:
    """Rank 0's core as its model thread sees it: the `LLMCore`, plus one broadcast of the
    commands applied since the last step before each step."""

    def __init__(self, core: LLMCore, group: mx.distributed.Group):
        self.core = core
        # A step that fails here (a rank died mid-collective) ends the model thread: its
        # requests get the restart's 503 and the daemon restarts the group.
        core.step_errors_are_fatal = True
        self._group = group
        self._pending: list[Command] = []
        self._keys: dict[Sequence, int] = {}  # sequences the followers know, until finished
        self._ids = itertools.count()
        self._started = False

    def start(self) -> None:
        self.core.start()
        self._started = True

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    @property
    def waiting(self) -> int:
        return self.core.waiting

    def hold_s(self) -> float:
        return self.core.hold_s()

    def add(self, sequence: Sequence) -> None:
        key = next(self._ids)
        self._keys[sequence] = key
        self._pending.append(("add", key, sequence.request, sequence.prompt_ids))
        self.core.add(sequence)

    def abort(self, sequence: Sequence) -> list[Output]:
        outputs = self.core.abort(sequence)
        key = self._keys.pop(sequence, None)
        if key is not None:
            self._pending.append(("abort", key))
        return outputs

    def step(self) -> list[Output]:
        if not self.core.has_work:
            return []  # the loop polls while idle; a step without work makes no generator call
        self._broadcast(("step", self.core.waiting, self.core.running))
        outputs = self.core.step()
        for sequence, _ in outputs:
            if sequence.status.finished:
                self._keys.pop(sequence, None)
        return outputs

    def fail_all(self, message: str, status: int = 500) -> list[Output]:
        """The loop's last call (closing, or its thread died): the followers stop too."""
        outputs = self.core.fail_all(message, status)
        self._keys.clear()
        if self._started:
            self._broadcast(("stop",))
        return outputs

    def _broadcast(self, last: Command) -> None:
        commands, self._pending = [*self._pending, last], []
        # On the generator's stream: see mlxd/distributed/broadcast.py.
        broadcast_object(commands, self._group, stream=self.core.executor.stream)


class FollowerCore:
    """A follower's core as its model thread sees it: every step waits for rank 0's commands
    and applies them; what its own core produces is discarded (rank 0 answers)."""

    def __init__(
        self,
        core: LLMCore,
        group: mx.distributed.Group,
        processors: Callable[[GenerationRequest], list[Any]],
    ):
        self.core = core
        self._group = group
        self._processors = processors
        self._sequences: dict[int, Sequence] = {}
        self.stopped = threading.Event()

    def start(self) -> None:
        self.core.start()

    @property
    def has_work(self) -> bool:
        return not self.stopped.is_set()  # always a next step to wait for, until told to stop

    @property
    def waiting(self) -> int:
        return 0

    def hold_s(self) -> float:
        return 0.0

    def add(self, sequence: Sequence) -> None:
        raise RuntimeError("a follower takes sequences from rank 0 only")

    def abort(self, sequence: Sequence) -> list[Output]:
        raise RuntimeError("a follower takes aborts from rank 0 only")

    def step(self) -> list[Output]:
        if self.stopped.is_set():
            return []
        commands: list[Command] = broadcast_object(
            None, self._group, stream=self.core.executor.stream
        )
        for command in commands:
            self._apply(command)
        return []

    def _apply(self, command: Command) -> None:
        kind = command[0]
        if kind == "add":
            _, key, request, prompt_ids = command
            sequence = Sequence(request, prompt_ids)
            # Built here as rank 0 built its own: the same grammar state on every rank.
            sequence.processors = self._processors(request)
            self._sequences[key] = sequence
            self.core.add(sequence)
        elif kind == "abort":
            aborted = self._sequences.pop(command[1], None)
            if aborted is not None:
                self.core.abort(aborted)
        elif kind == "step":
            own = (self.core.waiting, self.core.running)
            if own != command[1:]:
                raise RuntimeError(
                    f"diverged from rank 0: waiting/running {own} here, {command[1:]} there"
                )
            self.core.step()
            self._sequences = {k: s for k, s in self._sequences.items() if not s.status.finished}
        elif kind == "stop":
            self.stopped.set()

    def fail_all(self, message: str, status: int = 500) -> list[Output]:
        self.core.fail_all(message, status)
        return []


def rank_info() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname()}


def load_member(
    name: str, config: ModelConfig, path: Path, group: mx.distributed.Group, stream: mx.Stream
) -> tuple[LLMEngine, list[dict[str, Any]], FollowerCore | None]:
    """This rank's engine, every rank's `rank_info` and, on a follower, the core its thread
    follows with. Every rank calls it right after the spec broadcast, in the same order."""
    assert config.distributed is not None
    loaded = load_rank(
        path,
        strategy=config.distributed.strategy,
        model_name=name,
        dtype=config.dtype,
        group=group,
        kv_dtype=config.cache.kv_dtype,
    )
    ranks = gather_object(rank_info(), group, stream=stream)
    for index, info in enumerate(ranks):
        info["rank"] = index
    # Samplers at temperature > 0 draw from the global generator: the same seed on every rank.
    mx.random.seed(shared_seed(group, stream=stream))
    followers: list[FollowerCore] = []

    def leader(engine: LLMEngine) -> LeaderCore:
        return LeaderCore(engine.core, group)

    def follower(engine: LLMEngine) -> FollowerCore:
        # The engine's own grammar and fault processors, as rank 0's `prepare` builds them.
        followers.append(FollowerCore(engine.core, group, engine.request_processors))
        return followers[0]

    # No prefix cache: each rank's KV holds its own heads (tensor) or layers (pipeline), so a
    # cached prefix would be a set of per-rank shards to keep in step; not done (yet).
    engine = LLMEngine(name, config, loaded, None, leader if group.rank() == 0 else follower)
    return engine, ranks, followers[0] if followers else None


async def lead(
    name: str,
    config: ModelConfig,
    path: Path,
    server: Callable[[], ServerConfig],
    group: mx.distributed.Group,
) -> tuple[LLMEngine, dict[str, Any]]:
    """Rank 0's load (a worker.Loader), once the daemon said go: hand the followers what to
    load, load this rank's part, and the group's ranks for `describe`. `server` is unused: a
    distributed model has no SSD KV tier and no media."""
    log.info(
        "model '%s': prefix cache off for a distributed model: each rank holds only its shard "
        "of the KV cache",
        name,
    )

    def load() -> tuple[LLMEngine, list[dict[str, Any]]]:
        stream = mx.new_stream(mx.default_device())
        broadcast_object((name, config, path), group, stream=stream)
        engine, ranks, _ = load_member(name, config, path, group, stream)
        return engine, ranks

    engine, ranks = await asyncio.to_thread(load)
    return engine, {"ranks": ranks}


def follow(group: mx.distributed.Group) -> int:
    """A follower's life: wait for what to load, load, follow rank 0's steps until it stops
    (status 0) or this rank's thread dies (EXIT_FOLLOWER_FAILED; mlx.launch then ends the
    group, and the daemon restarts the model)."""
    stream = mx.new_stream(mx.default_device())
    received: tuple[str, ModelConfig, Path] = broadcast_object(None, group, stream=stream)
    name, config, path = received
    engine, _, follower = load_member(name, config, path, group, stream)
    assert follower is not None
    while not follower.stopped.wait(WATCH_S):
        if engine.failure is not None:
            log.critical("model '%s' rank %d: %s", name, group.rank(), engine.failure)
            return EXIT_FOLLOWER_FAILED
    asyncio.run(engine.close())
    return 0
