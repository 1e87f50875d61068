"""The synchronous core of a text or vision model: admission, steps, stops, cancellation.

No threads and no queues: the model's `ModelLoop` calls `add`, `abort` and `step` on its one
thread, and `step` returns the events it produced for every sequence at once. Each step, as
vLLM's `EngineCore.step`: `scheduler.schedule` plans it from the queue and the running rows,
the core starts the admitted sequences (prefix cache, image prefill), `executor.BatchExecutor`
runs the plan, and the core turns the tokens into events: it detokenizes, matches stop
strings and keeps one sequence's failure from failing the batch.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxd import kernels
from mlxd.config import BatchConfig, SpeculativeConfig
from mlxd.executor.batch import BatchExecutor, NewRow
from mlxd.executor.decode_batch import TokenOut
from mlxd.executor.prefill import SkipPrefillLogits
from mlxd.executor.sampling import (
    make_sequence_processors,
    make_sequence_sampler,
    token_logprob,
)
from mlxd.executor.speculative import make_speculator
from mlxd.models.lora import MultiLoRA
from mlxd.scheduler import Budget, Running, StepPlan, Waiting, schedule
from mlxd.types import Delta, Finished, FinishReason, GenerationRequest
from mlxd.worker import warm_up
from mlxd.worker.prompt_stores import PromptStores
from mlxd.worker.sequence import (
    FINAL_STATUS,
    CoreStats,
    Output,
    Sequence,
    SequenceStatus,
    guarded,
)

log = logging.getLogger("mlxd.scheduler")


class LLMCore:
    def __init__(
        self,
        name: str,
        model: Any,
        tokenizer: Any,
        batch: BatchConfig,
        speculative: SpeculativeConfig | None = None,
        draft_model: Any = None,
        warm_up: Callable[[], list[list[GenerationRequest]]] | None = None,
    ):
        """`draft_model`: speculative mode draft's model (the same vocabulary as `model`).
        `warm_up`: makes the rounds of requests `start` runs to their end and forgets
        (worker/warm_up.py; made on the model thread: it tokenizes)."""
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.config = batch
        self.stats = CoreStats()
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, Sequence] = {}  # by uid, in admission order
        self._uids = itertools.count()
        self._prompt_stores = PromptStores(lambda uid: self.executor.extract_cache(uid))
        self._eos = set(tokenizer.eos_token_ids)
        self._vocab_size = len(tokenizer)
        self._executor: BatchExecutor | None = None
        self._stream: mx.Stream  # made by start(), on the model thread
        # Outlives the executor (rebuilt after a failed step), so its counters do too.
        self.speculator = make_speculator(speculative, draft_model) if speculative else None
        # Set once a LoRA adapter is attached: each forward pass then routes its rows.
        self.lora: MultiLoRA | None = None
        # A failed step fails its batch and the core goes on, unless the step was collective
        # (a distributed group: a lost rank leaves nothing to go on with; worker/rank_cores.py).
        self.step_errors_are_fatal = False
        self._warm_up = warm_up
        self._stop_warm_up = threading.Event()  # set by a close during the warm-up
        # Each round run: the most rows a step of it ran, and its seconds (what compiled).
        self.warm_up_rounds: list[tuple[int, float]] = []

    def start(self) -> None:
        """On the model thread: MLX streams belong to the thread that made them. Everything
        this thread evaluates (prefix cache assembly too) goes on one stream, the only one
        whose CPU kernels use several threads."""
        self._stream = mx.new_stream(mx.default_device())
        mx.set_default_stream(self._stream)
        if self._stream.device == mx.cpu:
            kernels.parallelize_this_thread()
        self._executor = self._new_executor()
        if self._warm_up is not None:
            self.warm_up_rounds = warm_up.run(self, self._warm_up(), self._stop_warm_up)

    def stop_warm_up(self) -> None:
        """From any thread: no further warm-up round (the model is being closed)."""
        self._stop_warm_up.set()

    @property
    def executor(self) -> BatchExecutor:
        if self._executor is None:
            raise RuntimeError("LLMCore.start() must run first, on the model thread")
        return self._executor

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def hold_s(self) -> float:
        return 0.0  # decoders never wait for company

    def add(self, sequence: Sequence) -> None:
        """Queue; FIFO within a priority, higher priorities (interactive) ahead of lower."""
        sequence.uid = next(self._uids)
        priority = sequence.request.priority
        for index, waiting in enumerate(self._waiting):
            if waiting.request.priority < priority:
                self._waiting.insert(index, sequence)
                return
        self._waiting.append(sequence)

    def abort(self, sequence: Sequence) -> list[Output]:
        if sequence.status.finished:
            return []
        self.stats.cancelled += 1
        outputs: list[Output] = []
        cancelled = Finished("cancelled", len(sequence.prompt_ids), sequence.completion_tokens)
        self._finish(sequence, cancelled, outputs)
        return outputs

    def step(self) -> list[Output]:
        """Keep the prompt blocks of the last step's new sequences, then plan one step, start
        the sequences it admits and run it."""
        outputs: list[Output] = []
        self._prompt_stores.store_due(self._running)
        plan = schedule(self._waiting_view(), self._running_view(), self._budget())
        self._reject(plan.rejected, outputs)
        self._admit(plan.admitted, outputs)
        if plan.prefill or plan.decode:
            self._run(plan, outputs)
        return outputs

    def fail_all(self, message: str, status: int = 500) -> list[Output]:
        outputs: list[Output] = []
        for sequence in [*self._running.values(), *self._waiting]:
            self.stats.failed += 1
            event = Finished(
                "error",
                len(sequence.prompt_ids),
                sequence.completion_tokens,
                error=message,
                error_status=status,
            )
            self._finish(sequence, event, outputs, in_executor=False)
        return outputs

    def fail_batch(self, message: str) -> list[Output]:
        """`fail_all`, and a new executor: the failed rows stay in none."""
        outputs = self.fail_all(message)
        self._executor = self._new_executor()
        return outputs

    # -- admission ----------------------------------------------------------------------

    def _budget(self) -> Budget:
        return Budget(
            max_batch_size=self.config.max_batch_size,
            prefill_batch_size=self.config.prefill_batch_size,
            prefill_step_size=self.config.prefill_step_size,
            max_queue=self.config.max_queue,
            sample_in_prefill=self.executor.samples_in_prefill,
        )

    def _waiting_view(self) -> list[Waiting]:
        """The queue as the scheduler sees it. Only the first `prefill_batch_size` can be
        admitted in one step: only theirs are looked up in the prefix cache."""
        window = self.config.prefill_batch_size
        return [
            Waiting(
                s.uid,
                len(s.prompt_ids),
                s.lease.lookup() if s.lease is not None and index < window else 0,
            )
            for index, s in enumerate(self._waiting)
        ]

    def _running_view(self) -> list[Running]:
        return [Running(s.uid, len(s.prompt_ids), s.computed) for s in self._running.values()]

    def _reject(self, uids: tuple[int, ...], outputs: list[Output]) -> None:
        for sequence in [s for s in self._waiting if s.uid in uids]:
            self.stats.failed += 1
            error = f"model '{self.name}' has too many requests waiting; retry shortly"
            event = Finished("error", len(sequence.prompt_ids), 0, error=error, error_status=429)
            self._finish(sequence, event, outputs)

    def _admit(self, uids: tuple[int, ...], outputs: list[Output]) -> None:
        """Start the sequences the plan admits (the head of the queue) in the executor."""
        admitted = [self._waiting.popleft() for _ in uids]
        assert [s.uid for s in admitted] == list(uids), "the scheduler admits in queue order"
        rows = []
        for sequence, rest, cache in self._started(admitted, outputs):
            offset = len(sequence.prompt_ids) - len(rest)
            rows.append(
                NewRow(
                    sequence.uid,
                    rest,
                    sequence.request.max_tokens,
                    offset=offset,
                    cache=cache,
                    held=sequence.prompt_ids[:offset] if sequence.lease else [],
                    sampler=make_sequence_sampler(sequence.request.sampling, self._vocab_size),
                    logits_processors=guarded(
                        sequence,
                        make_sequence_processors(
                            sequence.request.sampling, sequence.request.max_tokens
                        )
                        + sequence.processors,
                    ),
                )
            )
            sequence.computed = offset
            sequence.detokenizer = self.tokenizer.detokenizer
            self._running[sequence.uid] = sequence
            self.stats.prompt_tokens += len(sequence.prompt_ids)
        self.executor.add(rows)

    def _started(
        self, admitted: list[Sequence], outputs: list[Output]
    ) -> list[tuple[Sequence, list[int], Any]]:
        """(sequence, prompt ids left to feed, KV cache or None) for each admitted sequence:
        from its cached prefix, or its own prefill if that worked (else it fails alone)."""
        ready = []
        for sequence in admitted:
            sequence.status = SequenceStatus.PREFILLING
            if sequence.prefill is None:
                cached = sequence.lease.match.tokens if sequence.lease else 0
                cache = sequence.lease.acquire() if sequence.lease else None
                ready.append((sequence, sequence.prompt_ids[cached:], cache))
                continue
            try:
                cache, rest = sequence.prefill()
            except Exception as exc:
                log.exception("model '%s': prompt prefill failed", self.name)
                self.stats.failed += 1
                failed = Finished("error", len(sequence.prompt_ids), 0, error=f"prefill: {exc}")
                self._finish(sequence, failed, outputs, in_executor=False)
                continue
            ready.append((sequence, rest, cache))
        return ready

    # -- running -------------------------------------------------------------------------

    def _run(self, plan: StepPlan, outputs: list[Output]) -> None:
        # A sequence admitted and failed at once (its image prefill) has no row to run.
        chunks = [chunk for chunk in plan.prefill if chunk.id in self._running]
        try:
            responses = self.executor.run(chunks, plan.decode)
        except Exception as exc:  # one bad step must not kill the engine: fail the batch, go on
            if self.step_errors_are_fatal:
                raise
            log.exception("model '%s': batch step failed", self.name)
            outputs.extend(self.fail_batch(f"generation failed: {exc}"))
            return
        for chunk in chunks:
            sequence = self._running.get(chunk.id)
            if sequence is not None:
                sequence.computed = max(sequence.computed, chunk.end)
        if not responses:
            return  # a prefill-only step
        self.stats.steps += 1
        # A row that accepted drafts answers with several tokens.
        rows = len({response.uid for response in responses})
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, rows)
        if rows > 1:
            self.stats.multi_sequence_steps += 1
        for response in responses:
            sequence = self._running.get(response.uid)
            if sequence is None:
                continue
            if sequence.fault is None:
                if sequence.status is SequenceStatus.PREFILLING:
                    self._prompt_stores.defer(sequence, response)
                try:
                    self._advance(sequence, response, outputs)
                except Exception as exc:
                    log.exception("model '%s': a sequence failed", self.name)
                    sequence.fault = f"{type(exc).__name__}: {exc}"
            if sequence.fault is not None and response.finish_reason is not None:
                self._fail(sequence, outputs, in_executor=False)
        for sequence in [s for s in self._running.values() if s.fault is not None]:
            self._fail(sequence, outputs)

    def _advance(self, sequence: Sequence, response: TokenOut, outputs: list[Output]) -> None:
        token, finish = response.token, response.finish_reason
        sequence.status = SequenceStatus.DECODING
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
            assert (
                response.logprobs is not None
            )  # its sampler computes them (make_sequence_sampler)
            logprobs = [token_logprob(response.logprobs, token, top, self._decode_one)]
        if stop is None and finish:
            text += sequence.stops.flush()
        if text or logprobs:
            outputs.append((sequence, Delta(text, [token], logprobs)))
        if stop is not None or finish:
            reason: FinishReason = finish if stop is None and finish is not None else "stop"
            done = Finished(reason, len(sequence.prompt_ids), sequence.completion_tokens, stop)
            self._finish(sequence, done, outputs, in_executor=finish is None)
            self.stats.finished += 1

    def _fail(self, sequence: Sequence, outputs: list[Output], in_executor: bool = True) -> None:
        """Fail one sequence whose own work raised; the rest of the batch goes on."""
        self.stats.failed += 1
        error = f"generation failed: {sequence.fault}"
        event = Finished("error", len(sequence.prompt_ids), sequence.completion_tokens, error=error)
        self._finish(sequence, event, outputs, in_executor)

    def _finish(
        self, sequence: Sequence, event: Finished, outputs: list[Output], in_executor: bool = True
    ) -> None:
        if sequence.status.finished:
            return
        if sequence.status is SequenceStatus.WAITING:
            self._waiting.remove(sequence)
        else:
            self._running.pop(sequence.uid, None)
            if in_executor:
                if event.reason != "error":
                    self._prompt_stores.store_now(sequence)
                self.executor.remove([sequence.uid])
        sequence.status = FINAL_STATUS[event.reason]
        if sequence.lease is not None:
            sequence.lease.release()
        outputs.append((sequence, event))

    def _new_executor(self) -> BatchExecutor:
        model = SkipPrefillLogits(self.model)
        model.route_rows = self._route_rows  # see executor.rows.RowBatch.route
        return BatchExecutor(
            model,
            stop_tokens=self._eos,
            stream=self._stream,
            speculator=self.speculator,
        )

    def _route_rows(self, uids: list[int]) -> None:
        if self.lora is not None:
            self.lora.set_rows([_slot(self._running.get(uid)) for uid in uids])

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _slot(sequence: Sequence | None) -> int:
    return 0 if sequence is None else sequence.slot
