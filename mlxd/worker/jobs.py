"""Whole-request jobs on a model thread: a FIFO core for models that answer one request per
step (a transcription, a synthesis), and the delivery of any job's result to its caller.

Such a model's call is long (seconds) and indivisible: one job per `step()` keeps the
`ModelLoop` responsive to aborts and close between jobs, and a job whose caller went away
before its turn is dropped unrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import mlx.core as mx

from mlxd.config import ModelConfig
from mlxd.errors import MlxdError, Unavailable
from mlxd.worker.loop import ModelLoop

log = logging.getLogger("mlxd.scheduler")

T = TypeVar("T")


class JobFailed(MlxdError):
    status = 500
    kind = "server_error"


class Delivered(Protocol):
    """What `deliver` needs of a job: the caller's loop and future."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def future(self) -> asyncio.Future[Any]: ...


@dataclass(eq=False)
class Job(Generic[T]):
    """One request: `run()` on the model thread answers it."""

    run: Callable[[], T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[T]


@dataclass
class JobStats:
    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    busy_seconds: float = 0.0  # time the model thread spent running jobs
    counters: dict[str, float] = field(default_factory=dict)  # the engine's own tallies


Output = tuple[Any, Any]  # (job, its result or the exception that failed it)


class JobCore:
    """A `Core` (worker/loop.py) running queued jobs first come, first served."""

    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what  # "transcription" …: names failures
        self.stats = JobStats()
        self._queue: deque[Job[Any]] = deque()
        self._stream: mx.Stream | None = None

    def start(self) -> None:
        self._stream = mx.new_stream(mx.default_device())  # streams belong to their thread

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def hold_s(self) -> float:
        return 0.0

    def add(self, job: Job[Any]) -> None:
        self.stats.requests += 1
        self._queue.append(job)

    def abort(self, job: Job[Any]) -> list[Output]:
        with contextlib.suppress(ValueError):
            self._queue.remove(job)
            self.stats.cancelled += 1
        return []

    def step(self) -> list[Output]:
        if not self._queue:  # the loop also steps after an idle poll
            return []
        job = self._queue.popleft()
        started = time.perf_counter()
        try:
            assert self._stream is not None, "start() runs first"
            with mx.stream(self._stream):
                result: Any = job.run()
            self.stats.completed += 1
        except MlxdError as exc:  # the request's own fault (a voice it lacks …)
            result = exc
            self.stats.failed += 1
        except Exception as exc:  # one bad job must not kill the engine
            log.exception("model '%s': %s failed", self.name, self.what)
            result = JobFailed(f"{self.what} failed: {type(exc).__name__}: {exc}")
            self.stats.failed += 1
        self.stats.busy_seconds += time.perf_counter() - started
        return [(job, result)]

    def fail_all(self, message: str, status: int = 500) -> list[Output]:
        error = Unavailable(message) if status == 503 else JobFailed(message)
        outputs: list[Output] = [(job, error) for job in self._queue]
        self.stats.failed += len(outputs)
        self._queue.clear()
        return outputs


JobLoop = ModelLoop[Job[Any], Output]


async def start_jobs(
    name: str, what: str, config: ModelConfig, load: Callable[[], T]
) -> tuple[T, JobCore, JobLoop]:
    """A job core, the model thread that runs it, and what `load()` returned, run as that
    thread's first job: mlx-audio's models keep arrays that belong to the stream of the thread
    that built them."""
    core = JobCore(name, what)
    loop: JobLoop = ModelLoop(name, core, deliver, config.batch.max_queue)
    try:
        loaded = await run_job(loop, load)
    except BaseException:
        await asyncio.to_thread(loop.close)
        raise
    core.stats = JobStats()  # the load is no request
    return loaded, core, loop


async def run_job(loop: JobLoop, run: Callable[[], T]) -> T:
    """`run()` on `loop`'s model thread, in turn; its result here. A caller that goes away
    before its turn drops it unrun."""
    event_loop = asyncio.get_running_loop()
    job: Job[T] = Job(run, event_loop, event_loop.create_future())
    loop.submit(job)
    try:
        return await job.future
    finally:
        if not job.future.done():
            loop.abort(job)


def deliver(outputs: list[tuple[Delivered, Any]]) -> None:
    """On the model thread: answer each finished job on its event loop."""
    for job, result in outputs:
        # A closed loop (shutdown) raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(_resolve, job.future, result)


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)
