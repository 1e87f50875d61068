"""The daemon's side of a worker process: an `Engine` whose model runs elsewhere.

`WorkerEngine.start` starts the worker and walks it through its load
(runtime/worker_process.py); after that the engine answers the API exactly like an in-process
one. One reader task takes the worker's messages: request acceptance, batches of events (one
per engine step), call replies. When the worker dies, for whatever reason, every request it
held ends with an error event (503) and `failure` says why; the reconciler restarts the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psutil

from mlxd.config import CacheConfig, ModelConfig, ServerConfig
from mlxd.errors import MlxdError, Unavailable
from mlxd.memory_need import MemoryNeed
from mlxd.models.adapters import adapter_bytes
from mlxd.runtime.engine import EventStream
from mlxd.runtime.rank_group import RankGroup
from mlxd.runtime.wire import read_message, write_message
from mlxd.runtime.worker_process import (
    WorkerProcess,
    describe_exit,
    process_handle,
    reap,
    start_worker,
)
from mlxd.types import (
    Finished,
    GenerationRequest,
    Speech,
    SpeechRequest,
    Transcript,
    TranscriptionRequest,
)

log = logging.getLogger("mlxd.worker")

CLOSE_TIMEOUT_S = 30.0
STATS_TIMEOUT_S = 2.0


class WorkerEngine:
    def __init__(
        self,
        name: str,
        config: ModelConfig,
        process: WorkerProcess,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        ready: dict[str, Any],
        server: Callable[[], ServerConfig],
        group: RankGroup | None = None,
    ):
        self.name = name
        self.kind: str = config.kind
        self.pid = process.pid
        self.estimate_bytes: int = ready["memory_bytes"]
        self._cache_ram = config.cache.ram
        self.chat_template: str | None = ready["chat_template"]
        self.tool_format: str | None = ready["tool_format"]
        self.last_used = time.monotonic()
        self.started_at = time.monotonic()
        self.failure: str | None = None
        self._process = process
        self._reader = reader
        self._writer = writer
        self._server = server
        self._server_sent = server()
        self._stats: dict[str, Any] = ready["stats"]
        self._streams: dict[int, asyncio.Queue[Any]] = {}
        # Weak: a stream dropped unread must still be collected (that cancels its sequence).
        self._readers: weakref.WeakValueDictionary[int, EventStream] = weakref.WeakValueDictionary()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        # Whole requests in flight (embeddings, transcriptions, speech): the engine is not idle.
        self._busy_calls = 0
        self._ids = itertools.count()
        self._closing = False
        self._psutil = process_handle(process.pid)
        # A distributed model: `process` is mlx.launch, rank 0 the worker it talks to.
        self._group = group
        self._watching: asyncio.Task | None = None
        if group is not None:
            group.started(ready["ranks"])
            self._watching = asyncio.create_task(group.watch(), name=f"mlxd-ranks-{name}")
        self._reading = asyncio.create_task(self._read(), name=f"mlxd-worker-{name}")

    @classmethod
    async def start(
        cls,
        name: str,
        config: ModelConfig,
        server: Callable[[], ServerConfig],
        make_room: Callable[[MemoryNeed], Awaitable[None]],
    ) -> WorkerEngine:
        """The engine of a worker started for `name` and loaded (see `start_worker`:
        `make_room(need)` runs before it loads, raising refuses)."""
        started = await start_worker(name, config, server, make_room)
        engine = cls(
            name,
            config,
            started.process,
            started.reader,
            started.writer,
            started.ready,
            server,
            started.group,
        )
        # The budget holds what was admitted (its KV at full batch and context, which the
        # worker fills only under load), not just what the worker holds at once.
        need = started.need
        engine.estimate_bytes = max(engine.estimate_bytes, need.total if need else 0)
        return engine

    # -- the Engine protocol -----------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self._streams and self._busy_calls == 0

    @property
    def memory_bytes(self) -> int:
        """What the budget counts: the worker's resident memory, once it exceeds the estimate
        (the estimate covers the KV budget the worker has not filled yet)."""
        return self._budgeted(self.rss_bytes)

    def _budgeted(self, rss: int | None) -> int:
        return max(self.estimate_bytes, rss or 0)

    @property
    def rss_bytes(self) -> int | None:
        if self._psutil is None or self.failure is not None:
            return None
        if self._group is not None:
            return self._group.rss_bytes()
        with contextlib.suppress(psutil.Error):
            return self._psutil.memory_info().rss
        return None

    async def submit(self, request: GenerationRequest) -> EventStream:
        self._check_alive()
        rid = next(self._ids)
        answers: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[rid] = answers
        self.last_used = time.monotonic()
        try:
            if self.kind == "vlm":
                self._send_server()
            self._send(("submit", rid, request))
            answer = await answers.get()  # accepted, rejected, or the worker's death
        except BaseException:
            self._abandon(rid)
            raise
        if isinstance(answer, Finished):  # died before answering
            self._streams.pop(rid, None)
            raise Unavailable(answer.error or f"model '{self.name}' is restarting")
        if answer[0] == "rejected":
            self._streams.pop(rid, None)
            raise answer[1]
        stream = EventStream(
            answers, answer[1], lambda: self._abandon(rid), lambda: self._forget(rid)
        )
        self._readers[rid] = stream
        return stream

    def _forget(self, rid: int) -> None:
        self._streams.pop(rid, None)
        self.last_used = time.monotonic()

    def _abandon(self, rid: int) -> None:
        """Forget request `rid`; the worker cancels its sequence if it still runs."""
        if self._streams.pop(rid, None) is not None and self.failure is None:
            self._send(("cancel", rid))

    def _cut_off(self, rid: int, backlog: int) -> None:
        stream = self._readers.get(rid)
        if stream is not None:
            stream.cut_off(backlog)
        else:
            self._abandon(rid)

    async def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return await self._call("count_prompt_tokens", request)

    async def embed(self, inputs: Any, *, truncate: bool, dimensions: int | None = None) -> Any:
        return await self._request("embed", inputs, truncate=truncate, dimensions=dimensions)

    async def transcribe(self, request: TranscriptionRequest) -> Transcript:
        return await self._request("transcribe", request)

    async def speak(self, request: SpeechRequest) -> Speech:
        return await self._request("speak", request)

    async def _request(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A whole request answered by one call (embeddings, transcriptions): it keeps the
        engine from being idle while it runs."""
        self._busy_calls += 1
        self.last_used = time.monotonic()
        try:
            return await self._call(method, *args, **kwargs)
        finally:
            self._busy_calls -= 1
            self.last_used = time.monotonic()

    def stats(self) -> dict[str, Any]:
        """The worker's figures as of the last `refresh_stats`, plus its process."""
        rss = self.rss_bytes  # one read of /proc for both figures
        return {
            **self._stats,
            "pid": self.pid,
            "rss_bytes": rss,
            "memory_estimate_bytes": self.estimate_bytes,
            "memory_bytes": self._budgeted(rss),
            **({"distributed": self._group.status()} if self._group is not None else {}),
        }

    async def refresh_stats(self) -> None:
        if self.failure is not None:
            return
        with contextlib.suppress(MlxdError, TimeoutError):
            self._stats = await asyncio.wait_for(self._call("stats"), STATS_TIMEOUT_S)

    def resize_cache(self, cache: CacheConfig) -> None:
        self.estimate_bytes += cache.ram - self._cache_ram
        self._cache_ram = cache.ram
        self._send(("call", next(self._ids), "resize_cache", (cache,), {}))  # reply unawaited

    async def attach_adapter(self, key: str, adapter: Path, model_name: str) -> None:
        """See LLMEngine.attach_adapter; the budget counts the adapter's weights too."""
        await self._call("attach_adapter", key, adapter, model_name)
        self.estimate_bytes += adapter_bytes(adapter)

    async def detach_adapter(self, key: str) -> None:
        await self._call("detach_adapter", key)

    async def close(self) -> None:
        """Ask the worker to finish and exit; kill it if it does not in time."""
        self._closing = True
        if self._watching is not None:
            self._watching.cancel()  # ranks exiting on close are no death
        if self._process.returncode is None:
            self._send(("close",))
            try:
                await asyncio.wait_for(self._process.wait(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("model '%s': worker %d did not exit; killing it", self.name, self.pid)
                await reap(self._process)
        if self._group is not None:
            await self._group.kill()  # every rank, not only the launcher
        await self._reading

    # -- transport ---------------------------------------------------------------------

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        cid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        try:
            self._send(("call", cid, method, args, kwargs))
            return await future
        except asyncio.CancelledError:
            self._send(("cancel", cid))  # e.g. an embedding whose caller went away
            raise
        finally:
            self._calls.pop(cid, None)

    def _send(self, message: tuple[Any, ...]) -> None:
        if not self._writer.is_closing():
            write_message(self._writer, message)

    def _send_server(self) -> None:
        current = self._server()
        if current is not self._server_sent:
            self._send(("server", current))
            self._server_sent = current

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise Unavailable(
                f"model '{self.name}' is restarting after a failure: {self.failure}",
                headers={"Retry-After": "5"},
            )

    async def _read(self) -> None:
        try:
            while True:
                kind, *args = await read_message(self._reader)
                if kind == "events":
                    backlog = self._server().stream_backlog
                    for rid, event in args[0]:
                        answers = self._streams.get(rid)
                        if answers is None:
                            continue
                        if answers.qsize() < backlog:
                            answers.put_nowait(event)
                        else:  # its reader stopped reading: bounded memory, a freed slot
                            self._cut_off(rid, backlog)
                elif kind in ("accepted", "rejected"):
                    answers = self._streams.get(args[0])
                    if answers is not None:
                        answers.put_nowait((kind, *args[1:]))
                elif kind in ("reply", "error"):
                    future = self._calls.get(args[0])
                    if future is None or future.done():
                        continue
                    if kind == "reply":
                        future.set_result(args[1])
                    else:
                        future.set_exception(args[1])
                elif kind == "died":  # its model thread died; the process exits next
                    self.failure = args[0]
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:
            log.exception("model '%s': unreadable message from worker %d", self.name, self.pid)
            self._process.kill()
        # Look before the group is killed whole: then every rank is dead.
        death = self._group.find_death() if self._group is not None else None
        status = await self._process.wait()
        self._writer.close()
        if self._group is not None:
            await self._group.kill()  # a group ends whole
        if self._closing:
            return
        failure = self.failure or f"worker {self.pid} {describe_exit(status)}"
        # Rank 0's error about a lost peer is a symptom: name the peer's death with it.
        self.failure = f"{death}: {failure}" if death and death not in failure else failure
        log.error("model '%s': %s", self.name, self.failure)
        self._fail_all(f"model '{self.name}' failed ({self.failure}); it is being restarted")

    def _fail_all(self, message: str) -> None:
        for answers in self._streams.values():
            answers.put_nowait(Finished("error", 0, 0, error=message, error_status=503))
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(Unavailable(message))
