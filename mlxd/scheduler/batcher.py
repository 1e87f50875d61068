"""Continuous batching on one dedicated model thread.

mlx-lm's `BatchGenerator` does the batched prefill/decode; this class owns the thread it runs
on, admission from a bounded queue, detokenization, stop strings and cancellation. The event
loop talks to the thread only through a thread-safe inbox; events go back through
`loop.call_soon_threadsafe`, once per step for all sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxd.cache import Match, PrefixCache
from mlxd.config import BatchConfig
from mlxd.errors import Overloaded, Unavailable
from mlxd.scheduler.fast_batch import FastBatchGenerator
from mlxd.scheduler.prefill import SkipPrefillLogits
from mlxd.scheduler.sampling import (
    make_sequence_processors,
    make_sequence_sampler,
    token_logprob,
)
from mlxd.scheduler.stops import StopMatcher
from mlxd.types import Delta, Event, Finished, GenerationRequest

log = logging.getLogger("mlxd.scheduler")

IDLE_POLL_S = 0.5


@dataclass(eq=False)
class Sequence:
    """One request's life inside the batcher. Touched only by the model thread once queued."""

    request: GenerationRequest
    prompt_ids: list[int]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event]
    uid: int | None = None
    completion_tokens: int = 0
    done: bool = False
    stops: StopMatcher | None = None
    detokenizer: Any = None
    # Extra per-sequence logits processors (constrained decoding), built off the model thread.
    processors: list[Any] = field(default_factory=list)
    # Set when this sequence's own work (logits processors, detokenizer, stops) raised: it
    # alone fails, after the step.
    fault: str | None = None
    # Prefills the prompt itself on the model thread (a VLM's image prompt, whose input
    # embeddings the token-only generator cannot take): returns the filled KV cache and the
    # prompt ids still to feed (the last one), so the sequence then decodes in the shared batch.
    # Such prompts bypass the prefix cache: image placeholder ids are the same for every image.
    prefill: Callable[[], tuple[list[Any], list[int]]] | None = None
    # Prefix cache: the prompt's block keys, and the cached blocks it holds while it runs.
    cache_keys: list[str] = field(default_factory=list)
    cached: Match = field(default_factory=Match)


@dataclass
class BatcherStats:
    steps: int = 0
    # Decode steps that carried more than one sequence: proof the batching batches.
    multi_sequence_steps: int = 0
    max_batch_seen: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0


class ContinuousBatcher:
    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        batch: BatchConfig,
        cache: PrefixCache | None = None,
    ):
        self.name = name
        self._cache = cache
        self.model = model
        self.tokenizer = tokenizer
        self.config = batch
        self.stats = BatcherStats()
        self._inbox: queue.SimpleQueue[tuple[str, Sequence | None]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}
        self._prefilling: set[int] = set()  # admitted uids still waiting for their first token
        self._queued = 0  # sequences submitted but not yet admitted; guarded by _lock
        self._lock = threading.Lock()
        self._eos = set(tokenizer.eos_token_ids)
        self._vocab_size = len(tokenizer)
        self._generator: FastBatchGenerator | None = None
        # Why the model thread died, if it did; the reconciler restarts the engine.
        self.failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"mlxd-model-{name}", daemon=True)
        self._thread.start()

    # -- event-loop side -------------------------------------------------------------------

    def submit(self, sequence: Sequence) -> None:
        with self._lock:
            if self.failure is not None:
                raise Unavailable(
                    f"model '{self.name}' is restarting after a failure: {self.failure}",
                    headers={"Retry-After": "5"},
                )
            if self._queued >= self.config.max_queue:
                raise Overloaded(
                    f"model '{self.name}' has {self._queued} requests waiting "
                    f"(batch.max_queue={self.config.max_queue}); retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._queued += 1
            self._inbox.put(("add", sequence))  # under the lock: never after a death's sweep

    def cancel(self, sequence: Sequence) -> None:
        self._inbox.put(("cancel", sequence))

    def close(self) -> None:
        self._inbox.put(("close", None))
        self._thread.join()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return self._queued

    # -- model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # Streams belong to the thread that made them, so the generator is built here.
            self._generator = self._new_generator()
            while True:
                idle = not self._running and not self._waiting
                if not self._drain_inbox(block=idle):
                    break
                self._admit()
                if self._running:
                    self._step()
        except BaseException as exc:
            log.critical("model '%s': engine thread died", self.name, exc_info=True)
            with self._lock:
                self.failure = f"engine thread died: {type(exc).__name__}: {exc}"
            # What was submitted before the death fails too (cancels no longer matter).
            with contextlib.suppress(queue.Empty):
                while True:
                    command, sequence = self._inbox.get_nowait()
                    if command == "add":
                        self._waiting.append(sequence)
            self._fail_all(f"model '{self.name}' failed ({self.failure}); it is being restarted")
            with self._lock:
                self._queued = 0  # every queued sequence was just failed
            return
        self._fail_all(f"model '{self.name}' was unloaded before this request finished")

    def _new_generator(self) -> FastBatchGenerator:
        stop_tokens = [[t] for t in sorted(self._eos)]
        return FastBatchGenerator(
            SkipPrefillLogits(self.model),
            stop_tokens=stop_tokens,
            completion_batch_size=self.config.max_batch_size,
            # Our admission forms the prefill groups; the generator must not split them.
            prefill_batch_size=self.config.max_batch_size,
            prefill_step_size=self.config.prefill_step_size,
            stream=mx.new_stream(mx.default_device()),
        )

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False once the batcher must stop."""
        while True:
            try:
                command, sequence = (
                    self._inbox.get(timeout=IDLE_POLL_S) if block else (self._inbox.get_nowait())
                )
            except queue.Empty:
                return True
            block = False
            if command == "close":
                return False
            if command == "add":
                self._enqueue(sequence)
            elif command == "cancel" and not sequence.done:
                self.stats.cancelled += 1
                cancelled = Finished(
                    "cancelled", len(sequence.prompt_ids), sequence.completion_tokens
                )
                self._remove(sequence, cancelled)

    def _enqueue(self, sequence: Sequence) -> None:
        """FIFO within a priority; higher priorities (interactive) ahead of lower (batches)."""
        priority = sequence.request.priority
        for index, waiting in enumerate(self._waiting):
            if waiting.request.priority < priority:
                self._waiting.insert(index, sequence)
                return
        self._waiting.append(sequence)

    def _admit(self) -> None:
        # One prefill group at a time: the next starts once this one has its first tokens.
        if self._prefilling:
            return
        slots = max(self.config.max_batch_size - len(self._running), 0)
        window = min(slots, self.config.prefill_batch_size)
        candidates = list(itertools.islice(self._waiting, window))
        matches = [self._match(s) for s in candidates]
        count = prefill_group_size(
            # With a cache hit only the uncached suffix is prefilled.
            [len(s.prompt_ids) - m.tokens for s, m in zip(candidates, matches, strict=True)],
            slots=slots,
            max_prompts=self.config.prefill_batch_size,
            token_budget=self.config.prefill_step_size,
        )
        if count == 0:
            return
        admitted = self._started([self._waiting.popleft() for _ in range(count)], matches)
        if not admitted:
            return
        uids = self._generator.insert(
            [rest for _, rest, _ in admitted],
            caches=[cache for _, _, cache in admitted],
            all_tokens=[s.prompt_ids[: s.cached.tokens] for s, _, _ in admitted],
            max_tokens=[s.request.max_tokens for s, _, _ in admitted],
            samplers=[
                make_sequence_sampler(s.request.sampling, self._vocab_size) for s, _, _ in admitted
            ],
            logits_processors=[
                _guarded(
                    s,
                    make_sequence_processors(s.request.sampling, s.request.max_tokens)
                    + s.processors,
                )
                for s, _, _ in admitted
            ],
        )
        for uid, (sequence, _, _) in zip(uids, admitted, strict=True):
            sequence.uid = uid
            sequence.stops = StopMatcher(sequence.request.stop)
            sequence.detokenizer = self.tokenizer.detokenizer
            self._running[uid] = sequence
            self._prefilling.add(uid)
            self.stats.prompt_tokens += len(sequence.prompt_ids)
        # Only now: between the two counts a sequence must never look absent (drains read them).
        with self._lock:
            self._queued -= len(admitted)

    def _started(
        self, admitted: list[Sequence], matches: list[Match]
    ) -> list[tuple[Sequence, list[int], Any]]:
        """(sequence, prompt ids left to feed, KV cache or None) for each admitted sequence: from
        its cached prefix, or its own prefill if that worked (a failure gets an error event)."""
        ready = []
        for sequence, match in zip(admitted, matches, strict=False):
            if sequence.prefill is None:
                cache = self._reuse(sequence, match)
                ready.append((sequence, sequence.prompt_ids[match.tokens :], cache))
                continue
            try:
                cache, rest = sequence.prefill()
            except Exception as exc:
                log.exception("model '%s': prompt prefill failed", self.name)
                self.stats.failed += 1
                with self._lock:
                    self._queued -= 1
                sequence.done = True
                failed = Finished("error", len(sequence.prompt_ids), 0, error=f"prefill: {exc}")
                self._deliver([(sequence, failed)])
                continue
            ready.append((sequence, rest, cache))
        return ready

    def _step(self) -> None:
        try:
            _, responses = self._generator.next()
        except Exception as exc:  # one bad step must not kill the engine: fail the batch, go on
            log.exception("model '%s': batch step failed", self.name)
            self._fail_all(f"generation failed: {exc}")
            self._generator = self._new_generator()
            return
        if not responses:
            return  # a prefill-only step
        self.stats.steps += 1
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(responses))
        if len(responses) > 1:
            self.stats.multi_sequence_steps += 1
        outbox: list[tuple[Sequence, Event]] = []
        for response in responses:
            sequence = self._running.get(response.uid)
            if sequence is None:
                continue
            if sequence.fault is None:
                if response.uid in self._prefilling:
                    self._store_prefix(sequence, response)
                try:
                    self._advance(sequence, response, outbox)
                except Exception as exc:
                    log.exception("model '%s': a sequence failed", self.name)
                    sequence.fault = f"{type(exc).__name__}: {exc}"
            if sequence.fault is not None and response.finish_reason is not None:
                self._fail(sequence, outbox, still_in_generator=False)
        for sequence in [s for s in self._running.values() if s.fault is not None]:
            self._fail(sequence, outbox)
        self._deliver(outbox)

    def _fail(self, sequence: Sequence, outbox: list, still_in_generator: bool = True) -> None:
        """Fail one sequence whose own work raised; the rest of the batch goes on."""
        self.stats.failed += 1
        error = f"generation failed: {sequence.fault}"
        event = Finished("error", len(sequence.prompt_ids), sequence.completion_tokens, error=error)
        self._remove(sequence, event, outbox, still_in_generator)

    def _advance(self, sequence: Sequence, response: Any, outbox: list) -> None:
        token, finish = response.token, response.finish_reason
        self._prefilling.discard(response.uid)
        sequence.completion_tokens += 1
        self.stats.generated_tokens += 1
        detok = sequence.detokenizer
        if not (finish == "stop" and token in self._eos):
            detok.add_token(token)
        if finish:
            detok.finalize()
        text, stop = sequence.stops.feed(detok.last_segment)
        logprobs = None
        top = sequence.request.sampling.top_logprobs
        if top is not None:
            logprobs = [token_logprob(response.logprobs, token, top, self._decode_one)]
        if stop is None and finish:
            text += sequence.stops.flush()
        if text or logprobs:
            outbox.append((sequence, Delta(text, [token], logprobs)))
        if stop is not None or finish:
            reason = "stop" if stop is not None else finish
            done = Finished(reason, len(sequence.prompt_ids), sequence.completion_tokens, stop)
            self._remove(sequence, done, outbox, still_in_generator=finish is None)
            self.stats.finished += 1

    def _remove(
        self,
        sequence: Sequence,
        event: Finished,
        outbox: list | None = None,
        still_in_generator: bool = True,
    ) -> None:
        if sequence.done:
            return
        sequence.done = True
        if self._cache is not None and sequence.cached.blocks:
            self._cache.release(sequence.cached.blocks)
        if sequence.uid is None:
            try:
                self._waiting.remove(sequence)
                with self._lock:
                    self._queued -= 1
            except ValueError:
                pass
        else:
            self._running.pop(sequence.uid, None)
            self._prefilling.discard(sequence.uid)
            if still_in_generator:
                self._generator.remove([sequence.uid])
        if outbox is None:
            self._deliver([(sequence, event)])
        else:
            outbox.append((sequence, event))

    def _fail_all(self, message: str) -> None:
        outbox: list[tuple[Sequence, Event]] = []
        for sequence in [*self._running.values(), *self._waiting]:
            self.stats.failed += 1
            event = Finished(
                "error", len(sequence.prompt_ids), sequence.completion_tokens, error=message
            )
            self._remove(sequence, event, outbox, still_in_generator=False)
        self._deliver(outbox)

    # -- prefix cache (mlxd.cache) ---------------------------------------------------------

    def _match(self, sequence: Sequence) -> Match:
        if self._cache is None or not sequence.cache_keys:
            return Match()
        return self._cache.match(sequence.prompt_ids, sequence.cache_keys)

    def _reuse(self, sequence: Sequence, match: Match) -> list[Any] | None:
        """The KV cache to start the sequence's prefill from (None: from scratch)."""
        if self._cache is None:
            return None
        sequence.cached = match
        return self._cache.acquire(match) or None

    def _store_prefix(self, sequence: Sequence, response: Any) -> None:
        """On a sequence's first token its whole prompt is in its KV: keep the new blocks."""
        keys = sequence.cache_keys
        if self._cache is None or not self._cache.missing(keys):
            return
        try:
            layers = response.prompt_cache  # set when the sequence has already finished
            if layers is None:
                layers, _ = self._generator.extract_cache([response.uid])[response.uid]
            self._cache.store(sequence.prompt_ids, keys, layers)
        except Exception:  # a cache failure costs future hits, never this request
            log.exception("model '%s': storing prompt blocks failed", self.name)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    @staticmethod
    def _deliver(outbox: list[tuple[Sequence, Event]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sequence, Event]]] = {}
        for sequence, event in outbox:
            by_loop.setdefault(sequence.loop, []).append((sequence, event))
        for loop, items in by_loop.items():
            # A closed loop (shutdown) raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)


def prefill_group_size(
    prompt_lengths: list[int], *, slots: int, max_prompts: int, token_budget: int
) -> int:
    """How many of the waiting prompts (in arrival order) to prefill together.

    As many as fit the free slots, `max_prompts` and `token_budget` prompt tokens; a first
    prompt longer than the budget goes alone (it is prefilled in budget-sized chunks).
    Prefilling many short prompts in one forward pass is far cheaper than one by one, and the
    budget bounds how long one prefill step stalls the running decoders.
    """
    count, tokens = 0, 0
    for length in prompt_lengths[: min(slots, max_prompts)]:
        if count and tokens + length > token_budget:
            break
        count, tokens = count + 1, tokens + length
    return count


def _guarded(sequence: Sequence, processors: list[Any]) -> list[Any]:
    """The sequence's logits processors as one that records an exception on the sequence
    instead of raising it out of the batched step (which would fail every sequence)."""
    if not processors:
        return []  # no processors keeps mlx-lm's fast path

    def process(tokens: Any, logits: Any) -> Any:
        if sequence.fault is not None:
            return logits
        try:
            for processor in processors:
                logits = processor(tokens, logits)
        except Exception as exc:
            log.exception("logits processor of a sequence failed")
            sequence.fault = f"{type(exc).__name__}: {exc}"
        return logits

    return [process]


def _put_all(items: list[tuple[Sequence, Event]]) -> None:
    for sequence, event in items:
        sequence.events.put_nowait(event)
