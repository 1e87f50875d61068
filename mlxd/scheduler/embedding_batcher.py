"""Coalesce concurrent embedding requests into batched forward passes on one model thread.

A pass over one short input is mostly fixed overhead (dozens of small ops, matmuls too thin to
use the BLAS well), so inputs from every waiting request are pooled: when the thread is idle it
takes a request, waits a few milliseconds for those already being tokenized, then takes a round
of waiting inputs, sorts them by length (less padding) and cuts the round into forward passes of
at most `batch.max_batch_size` inputs and `batch.prefill_step_size` padded tokens. A request with
many inputs is split across passes; it is answered once all its vectors are in. Like the LLM
batcher, the event loop talks to the thread only through the inbox and
`loop.call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxd.config import BatchConfig
from mlxd.errors import MlxdError, Overloaded

log = logging.getLogger("mlxd.scheduler")

IDLE_POLL_S = 0.5
# How long an idle thread waits for requests that are on their way (being tokenized) before
# the first pass: short against a pass (≈10–50 ms), long enough for a burst of concurrent
# requests to arrive together. With none on the way a lone request runs at once.
COLLECT_WINDOW_S = 0.005
COLLECT_POLL_S = 0.0005
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
    taken: int = 0  # inputs handed to a round so far (model thread)
    remaining: int = 0  # inputs without a vector yet (model thread)
    cancelled: bool = False  # set by the event loop when the caller goes away: inputs skipped

    def __post_init__(self) -> None:
        self.remaining = len(self.inputs)


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


class EmbeddingBatcher:
    def __init__(
        self, name: str, forward: Forward, batch: BatchConfig, arriving: Callable[[], int]
    ):
        self.name = name
        self.forward = forward
        self._arriving = arriving  # requests about to be submitted (e.g. being tokenized)
        self.config = batch
        self.stats = EmbeddingStats()
        self._inbox: queue.SimpleQueue[EmbeddingJob | None] = queue.SimpleQueue()
        self._open = 0  # jobs submitted and not yet answered; guarded by _lock
        # Model thread only: jobs taken and not yet answered (in arrival order), and whether
        # close was asked.
        self._active: dict[EmbeddingJob, None] = {}
        self._closing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mlxd-embed-{name}", daemon=True)
        self._thread.start()

    # -- event-loop side -------------------------------------------------------------------

    def submit(self, job: EmbeddingJob) -> None:
        with self._lock:
            if self._open >= self.config.max_queue:
                raise Overloaded(
                    f"model '{self.name}' has {self._open} requests waiting "
                    f"(batch.max_queue={self.config.max_queue}); retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._open += 1
        self._inbox.put(job)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    @property
    def open_requests(self) -> int:
        return self._open

    # -- model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())  # streams belong to their thread
        with mx.stream(stream):
            while not self._closing:
                self._collect()
                if self._untaken() and not self._closing:
                    self._round()
        self._fail(list(self._active), f"model '{self.name}' was unloaded")

    def _collect(self) -> None:
        """Move new jobs into the pending inputs; when idle, wait for one, then up to a short
        window for the requests on their way (unless a full pass is already there)."""
        if not self._untaken():
            try:
                self._take(self._inbox.get(timeout=IDLE_POLL_S))
            except queue.Empty:
                return
            deadline = time.monotonic() + COLLECT_WINDOW_S
            while (
                not self._closing
                and self._untaken() < self.config.max_batch_size
                and self._arriving() > 0
                and time.monotonic() < deadline
            ):
                with contextlib.suppress(queue.Empty):
                    self._take(self._inbox.get(timeout=COLLECT_POLL_S))
        self._drain_inbox()

    def _drain_inbox(self) -> None:
        while not self._closing:
            try:
                self._take(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _take(self, job: EmbeddingJob | None) -> None:
        if job is None:
            self._closing = True
            return
        self.stats.requests += 1
        self._active[job] = None

    def _untaken(self) -> int:
        return sum(len(job.inputs) - job.taken for job in self._active)

    def _round(self) -> None:
        """Plan waiting inputs together and run them; new jobs wait for the next round.

        Inputs are taken round-robin across requests, so a request with thousands of inputs
        does not hold back the short ones that arrive while it runs.
        """
        limit = self.config.max_batch_size * ROUND_BATCHES
        round_: list[tuple[EmbeddingJob, int]] = []
        jobs = deque(
            job
            for job in list(self._active)
            if not self._drop_if_cancelled(job) and job.taken < len(job.inputs)
        )
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
            self._pass([round_[i] for i in batch])
            self._drain_inbox()
            if self._closing:
                return

    def _pass(self, items: list[tuple[EmbeddingJob, int]]) -> None:
        live = [(j, i) for j, i in items if j in self._active and not self._drop_if_cancelled(j)]
        if not live:
            return
        batch = [job.inputs[index] for job, index in live]
        started = time.perf_counter()
        try:
            vectors = self.forward(batch)
        except Exception as exc:  # one bad pass must not kill the engine
            log.exception("model '%s': embedding pass failed", self.name)
            self._fail([job for job, _ in live], f"embedding failed: {exc}")
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
                self._settle(job, job.vectors)

    def _drop_if_cancelled(self, job: EmbeddingJob) -> bool:
        if job.cancelled:
            self.stats.cancelled += 1
            self._settle(job)
        return job.cancelled

    def _fail(self, jobs: list[EmbeddingJob], message: str) -> None:
        for job in dict.fromkeys(jobs):
            if job in self._active:
                self.stats.failed += 1
                self._settle(job, EmbeddingFailed(message))

    def _settle(self, job: EmbeddingJob, result: np.ndarray | Exception | None = None) -> None:
        """The job leaves the batcher (its remaining inputs are skipped); answer it if asked."""
        del self._active[job]
        with self._lock:
            self._open -= 1
        if result is not None:
            # A closed loop (shutdown) raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(_resolve, job.future, result)


def _resolve(future: asyncio.Future[np.ndarray], result: np.ndarray | Exception) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
