"""The synchronous core of an embedding model: concurrent requests coalesced into passes.

A pass over one short input is mostly fixed overhead (dozens of small ops, matmuls too thin to
use the BLAS well), so inputs from every waiting request are pooled: when idle the core holds
its first pass a few milliseconds for requests already on their way (being tokenized), then
plans a round of waiting inputs, sorts them by length (less padding) and cuts the round into
passes of at most `batch.max_batch_size` inputs and `batch.prefill_step_size` padded tokens;
each `step()` runs one pass. A request with many inputs is split across passes; it is answered
once all its vectors are in. Driven by a `ModelLoop`, like the LLM core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxd.config import BatchConfig
from mlxd.errors import MlxdError, Unavailable

log = logging.getLogger("mlxd.scheduler")

# How long an idle core waits for requests that are on their way before its first pass:
# short against a pass (≈10–50 ms), long enough for a burst of concurrent requests to arrive
# together. With none on the way a lone request runs at once.
COLLECT_WINDOW_S = 0.005
# Inputs planned together (sorted by length) per round, in multiples of max_batch_size.
ROUND_BATCHES = 4

Forward = Callable[[list[list[int]]], np.ndarray]


class EmbeddingFailed(MlxdError):
    status = 500
    kind = "server_error"


@dataclass(eq=False)
class EmbeddingJob:
    """One request's inputs (token ids, special tokens included) and where its vectors go."""

    inputs: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[np.ndarray]
    vectors: np.ndarray | None = None  # filled on the model thread
    taken: int = 0  # inputs handed to a round so far
    remaining: int = 0  # inputs without a vector yet

    def __post_init__(self) -> None:
        self.remaining = len(self.inputs)


# A job and the vectors that answer it (or why it failed).
Output = tuple[EmbeddingJob, np.ndarray | Exception]
Pass = list[tuple[EmbeddingJob, int]]  # (job, index of one of its inputs)


@dataclass
class EmbeddingStats:
    requests: int = 0
    inputs: int = 0
    forward_passes: int = 0
    forward_seconds: float = 0.0  # time the model thread spent in passes
    # Passes that carried inputs of more than one request: proof the coalescing coalesces.
    multi_request_passes: int = 0
    max_batch_seen: int = 0
    tokens: int = 0
    padded_tokens: int = 0  # tokens computed, padding included
    cancelled: int = 0
    failed: int = 0


def plan_batches(lengths: list[int], *, max_batch_size: int, token_budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into forward passes, shortest first.

    Each pass holds at most `max_batch_size` inputs whose padded size (count × longest) stays
    within `token_budget`; an input longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[index]  # sorted: the newest member is the widest
        full = len(current) >= max_batch_size or (len(current) + 1) * width > token_budget
        if current and full:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


class EmbeddingCore:
    def __init__(
        self, name: str, forward: Forward, batch: BatchConfig, arriving: Callable[[], int]
    ):
        self.name = name
        self.forward = forward
        self.config = batch
        self._arriving = arriving  # requests about to be submitted (e.g. being tokenized)
        self.stats = EmbeddingStats()
        self._active: dict[EmbeddingJob, None] = {}  # taken, not yet answered (arrival order)
        self._round: deque[Pass] = deque()  # planned passes not run yet
        self._stream: mx.Stream | None = None

    def start(self) -> None:
        self._stream = mx.new_stream(mx.default_device())  # streams belong to their thread

    @property
    def stream(self) -> mx.Stream:
        if self._stream is None:
            raise RuntimeError("EmbeddingCore.start() must run first, on the model thread")
        return self._stream

    @property
    def has_work(self) -> bool:
        return bool(self._round) or self._untaken() > 0

    @property
    def waiting(self) -> int:
        return len(self._active)

    def hold_s(self) -> float:
        """At the start of a round, while a pass is not full and requests are on their way."""
        gathering = not self._round and 0 < self._untaken() < self.config.max_batch_size
        return COLLECT_WINDOW_S if gathering and self._arriving() > 0 else 0.0

    def add(self, job: EmbeddingJob) -> None:
        self.stats.requests += 1
        self._active[job] = None

    def abort(self, job: EmbeddingJob) -> list[Output]:
        """The caller went away: its remaining inputs are skipped."""
        if job in self._active:
            self.stats.cancelled += 1
            del self._active[job]
        return []

    def step(self) -> list[Output]:
        if not self._round:
            self._plan_round()
        outputs: list[Output] = []
        if self._round:
            self._pass(self._round.popleft(), outputs)
        return outputs

    def fail_all(self, message: str, status: int = 500) -> list[Output]:
        error = Unavailable(message) if status == 503 else EmbeddingFailed(message)
        outputs: list[Output] = [(job, error) for job in self._active]
        self.stats.failed += len(outputs)
        self._active.clear()
        self._round.clear()
        return outputs

    def _untaken(self) -> int:
        return sum(len(job.inputs) - job.taken for job in self._active)

    def _plan_round(self) -> None:
        """Plan waiting inputs together; new jobs wait for the next round.

        Inputs are taken round-robin across requests, so a request with thousands of inputs
        does not hold back the short ones that arrive while it runs.
        """
        limit = self.config.max_batch_size * ROUND_BATCHES
        round_: Pass = []
        jobs = deque(job for job in self._active if job.taken < len(job.inputs))
        while jobs and len(round_) < limit:
            job = jobs.popleft()
            round_.append((job, job.taken))
            job.taken += 1
            if job.taken < len(job.inputs):
                jobs.append(job)
        lengths = [len(job.inputs[index]) for job, index in round_]
        for batch in plan_batches(
            lengths,
            max_batch_size=self.config.max_batch_size,
            token_budget=self.config.prefill_step_size,
        ):
            self._round.append([round_[i] for i in batch])

    def _pass(self, items: Pass, outputs: list[Output]) -> None:
        live = [(job, index) for job, index in items if job in self._active]  # not aborted
        if not live:
            return
        batch = [job.inputs[index] for job, index in live]
        started = time.perf_counter()
        try:
            with mx.stream(self.stream):
                vectors = self.forward(batch)
        except Exception as exc:  # one bad pass must not kill the engine
            log.exception("model '%s': embedding pass failed", self.name)
            for job in dict.fromkeys(job for job, _ in live):
                self.stats.failed += 1
                del self._active[job]
                outputs.append((job, EmbeddingFailed(f"embedding failed: {exc}")))
            return
        s = self.stats
        s.forward_passes += 1
        s.forward_seconds += time.perf_counter() - started
        s.inputs += len(batch)
        s.max_batch_seen = max(s.max_batch_seen, len(batch))
        s.tokens += sum(map(len, batch))
        s.padded_tokens += len(batch) * max(map(len, batch))
        if len({id(job) for job, _ in live}) > 1:
            s.multi_request_passes += 1
        for (job, index), vector in zip(live, vectors, strict=True):
            if job.vectors is None:
                job.vectors = np.empty((len(job.inputs), vectors.shape[-1]), dtype=np.float32)
            job.vectors[index] = vector
            job.remaining -= 1
            if job.remaining == 0:
                del self._active[job]
                outputs.append((job, job.vectors))
