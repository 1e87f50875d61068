"""One model thread for every kind of engine: inbox, run loop, crash guard, delivery.

A core (`core.LLMCore`, `embedding_core.EmbeddingCore`) is synchronous: `add`, `abort`, `step`.
`ModelLoop` owns the one thread that drives it (MLX streams belong to their thread, and the
event loop must never block on a model step). The API side talks to it only through a
thread-safe inbox; what a step produced goes out in one `deliver` call. If the thread dies, for
any reason, everything it held fails with the reason, `failure` says it, and new work is refused
(the reconciler restarts the model).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from mlxd.errors import Overloaded, Unavailable

log = logging.getLogger("mlxd.scheduler")

IDLE_POLL_S = 0.5
HOLD_POLL_S = 0.0005

Item = TypeVar("Item")
Output = TypeVar("Output")
ItemIn = TypeVar("ItemIn", contravariant=True)


class Core(Protocol[ItemIn, Output]):
    def start(self) -> None:
        """Called on the model thread before anything else."""
        ...

    @property
    def has_work(self) -> bool: ...

    @property
    def waiting(self) -> int:
        """Items added and not yet running (what `max_queue` bounds)."""
        ...

    def hold_s(self) -> float:
        """How long to wait for more items before the next step (0: step now)."""
        ...

    def add(self, item: ItemIn) -> None: ...

    def abort(self, item: ItemIn) -> list[Output]: ...

    def step(self) -> list[Output]: ...

    def fail_all(self, message: str, status: int = 500) -> list[Output]: ...


class ModelLoop(Generic[Item, Output]):
    def __init__(
        self,
        name: str,
        core: Core[Item, Output],
        deliver: Callable[[list[Output]], None],
        max_queue: int,
    ):
        self.name = name
        self.core = core
        self._deliver = deliver
        self._max_queue = max_queue
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_inbox = 0  # adds not yet taken by the thread; guarded by _lock
        self.failure: str | None = None  # why the thread died, if it did
        # Set once the core's `start` returned (or the thread died in it): a load that
        # warms the core up waits for it.
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"mlxd-model-{name}", daemon=True)
        self._thread.start()

    # -- any thread ----------------------------------------------------------------------

    def submit(self, item: Item) -> None:
        """Queue `item`; `Overloaded` past `max_queue`, `Unavailable` once the thread died."""
        with self._lock:
            if self.failure is not None:
                raise Unavailable(
                    f"model '{self.name}' is restarting after a failure: {self.failure}",
                    headers={"Retry-After": "5"},
                )
            queued = self.waiting
            if queued >= self._max_queue:
                raise Overloaded(
                    f"model '{self.name}' has {queued} requests waiting "
                    f"(batch.max_queue={self._max_queue}); retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._in_inbox += 1
            self._inbox.put(("add", item))  # under the lock: never after a death's sweep

    def abort(self, item: Item) -> None:
        self._inbox.put(("abort", item))

    def close(self) -> None:
        """Stop after the current step; what is still held fails. Joins the thread."""
        self._inbox.put(("close", None))
        self._thread.join()

    @property
    def waiting(self) -> int:
        """Added and not running yet. The core's count is read live (a length, safe to read
        from another thread): a long step must not keep counting what it already admitted."""
        return self._in_inbox + self.core.waiting

    # -- the model thread ----------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            core.start()
            self.started.set()
            while self._take(block=not core.has_work) and self._hold():
                outputs = core.step()
                if outputs:
                    self._deliver(outputs)
        except BaseException as exc:
            log.critical("model '%s': engine thread died", self.name, exc_info=True)
            try:
                with self._lock:
                    self.failure = f"engine thread died: {type(exc).__name__}: {exc}"
                    # What was submitted before the death fails too (aborts no longer matter).
                    with contextlib.suppress(queue.Empty):
                        while True:
                            command, item = self._inbox.get_nowait()
                            if command == "add":
                                core.add(item)
                    self._in_inbox = 0
            finally:
                self.started.set()  # after `failure`: a load waiting on it reads why
            message = f"model '{self.name}' failed ({self.failure}); it is being restarted"
            self._deliver_quietly(core.fail_all(message, status=503))
            return
        self._deliver_quietly(
            core.fail_all(
                f"model '{self.name}' was unloaded before this request finished", status=503
            )
        )

    def _take(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once closing."""
        while True:
            try:
                command, item = (
                    self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
                )
            except queue.Empty:
                return True
            block = False
            if not self._apply(command, item):
                return False

    def _hold(self) -> bool:
        """Let the core gather company for its next step (embedding passes do); False once
        closing."""
        deadline = time.monotonic() + self.core.hold_s()
        while time.monotonic() < deadline and self.core.hold_s() > 0:
            with contextlib.suppress(queue.Empty):
                if not self._apply(*self._inbox.get(timeout=HOLD_POLL_S)):
                    return False
        return True

    def _apply(self, command: str, item: Any) -> bool:
        if command == "close":
            return False
        if command == "add":
            self.core.add(item)  # first: for a moment it counts twice, never not at all
            with self._lock:
                self._in_inbox -= 1
        elif command == "abort":
            outputs = self.core.abort(item)
            if outputs:
                self._deliver(outputs)
        return True

    def _deliver_quietly(self, outputs: list[Output]) -> None:
        with contextlib.suppress(Exception):
            if outputs:
                self._deliver(outputs)
