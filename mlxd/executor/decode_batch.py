"""Rows past their prompts: one decode step for all of them per `next()`.

The step samples through `sampling.sample_rows`: greedy rows that did not ask for logprobs
take the argmax of the raw logits, and only rows that need log-probabilities get them (mlx-lm
normalises every row every step: ≈28 ms of a ≈317 ms step at batch 32 over SmolLM2's 49k
vocabulary on the CPU). With a speculator (see speculative.py) a step may verify drafts and
give a row several tokens, each passed through max_tokens and the stop tokens in order.

Pipelining: a step hands out the previous step's tokens once it has started its own
(`mx.async_eval`). On the CPU, MLX's `async_eval` returns only once all but the last few ops
of the graph have run, so a first token would come out a whole step after it was computed.
A row's first token is therefore handed out by the step that computes it (`Row.fresh`); from
its second token on the row is pipelined again, which is faster at batch 1 (measured:
handing every token out at once lost ≈25% of the batch-1 throughput).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, TokenBuffer

from mlxd.executor.rows import Row, RowBatch, row_view, trim_allocation
from mlxd.executor.sampling import sample_rows
from mlxd.executor.speculative import Speculator, accepted_count, roll_back


@dataclass
class TokenOut:
    """A token a row produced. On its last token (`finish_reason` set) the row has left the
    batch and `prompt_cache` holds its KV."""

    uid: int
    token: int
    logprobs: mx.array | None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_cache: list[Any] | None = None


# Per row: the tokens of one step and, per token, its log-probabilities (None where skipped).
_Step = tuple[list[list[int]], list[list[Any]]]


class DecodeBatch(RowBatch):
    def __init__(
        self, model: Any, stop_tokens: Collection[int], speculator: Speculator[Any] | None = None
    ):
        super().__init__(model, [], [])
        self.stop_tokens = frozenset(stop_tokens)
        self.speculator = speculator
        # The tokens the next step feeds (one per row), sampled by the last step, and their
        # log-probabilities where a row asked for them.
        self._pending: mx.array | None = None
        self._pending_logprobs: list[Any] = []

    def join(self, rows: list[Row], cache: list[Any], last: list[int]) -> None:
        """Rows whose caches hold their prompts but for the `last` tokens: the next step
        feeds those and hands out each row's first token."""
        _start_contexts(rows)
        for row, token in zip(rows, last, strict=True):
            row.tokens.append(token)
            row.fresh = True
        self.extend(self._batch(rows, cache, mx.array(last), [None] * len(rows)))

    def join_sampled(
        self, rows: list[Row], cache: list[Any], last: list[int], logits: mx.array
    ) -> list[TokenOut]:
        """Rows whose prefill fed their `last` prompt tokens too and returned the `logits`
        after them: their first tokens now; the rows that go on decode from the next step."""
        _start_contexts(rows)
        logits, context = _process(rows, logits, mx.array(last))
        firsts, logprobs = sample_rows(logits, [row.sampler for row in rows])
        mx.eval(firsts, _present(logprobs), context)
        tokens = cast(list[int], firsts.tolist())
        for row, last_token, first in zip(rows, last, tokens, strict=True):
            row.tokens += [last_token, first]
            row.early = True  # its first token goes out now; the next step feeds it
        joining = self._batch(rows, cache, firsts, logprobs)
        out = joining._emit([[t] for t in tokens], [[lp] for lp in logprobs])
        self.extend(joining)
        return out

    def next(self) -> list[TokenOut]:
        """One step: each row's tokens in order; the rows that finished leave the batch."""
        if not self.rows:
            return []
        tokens, logprobs = self._step()
        if not any(tokens):  # every row between its first two tokens: no empty answer
            tokens, logprobs = self._step()
        return self._emit(tokens, logprobs)

    def extend(self, other: RowBatch) -> None:
        # mlx-lm pads both batches' KV buffers to the larger allocation and concatenates
        # them: copy the positions in use and the allocation step they are in, no more.
        for cache in [*self.cache, *other.cache]:
            if isinstance(cache, BatchKVCache):
                trim_allocation(cache, (cache.size() // cache.step + 1) * cache.step)
        joining = cast(DecodeBatch, other)
        if joining._pending is not None:
            pending = [p for p in (self._pending, joining._pending) if p is not None]
            self._pending = mx.concatenate(pending) if len(pending) > 1 else pending[0]
        self._pending_logprobs += joining._pending_logprobs
        joining._pending, joining._pending_logprobs = None, []
        super().extend(other)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        assert self._pending is not None
        self._pending = self._pending[mx.array(keep)] if keep else None
        self._pending_logprobs = [self._pending_logprobs[i] for i in keep]
        if self.speculator is not None:  # free what it keeps for the rows that left
            self.speculator.retain(self.uids)

    def extract_cache(self, index: int) -> list[Any]:
        """The row's KV as views into the batch's. mlxd's one caller, the prefix cache's
        store, copies the blocks it keeps and lets the rest go at once: ≈ 17 ms and 70 MB
        not copied after a 1,600-token prompt on SmolLM2."""
        return [row_view(cache, index) for cache in self.cache]

    def _batch(
        self, rows: list[Row], cache: list[Any], pending: mx.array, logprobs: list[Any]
    ) -> DecodeBatch:
        """A batch of these rows with the tokens the next step feeds them."""
        batch = DecodeBatch(self.model, self.stop_tokens)
        batch.rows, batch.cache = rows, cache
        batch._pending, batch._pending_logprobs = pending, logprobs
        return batch

    def _step(self) -> _Step:
        self.route()
        drafts = self._drafts()
        if drafts is not None:
            return self._speculative_step(drafts)
        inputs, inputs_logprobs = self._pending, self._pending_logprobs
        assert inputs is not None
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        logits, context = _process(self.rows, logits, inputs)
        self._pending, self._pending_logprobs = sample_rows(logits, self._samplers())
        computed = [self._pending, _present(self._pending_logprobs), context]
        if any(row.fresh for row in self.rows):
            mx.eval(*computed)  # first tokens go out now
            firsts = cast(list[int], self._pending.tolist())
        else:
            # Start the next step's compute while this step's tokens are handed out.
            mx.async_eval(*computed)
            firsts = []
        mx.eval(inputs, _present(inputs_logprobs))
        # A 1-D array's tolist() is a list of ints; the stub types it as any nesting.
        fed = cast(list[int], inputs.tolist())
        tokens: list[list[int]] = []
        logprobs: list[list[Any]] = []
        for i, row in enumerate(self.rows):
            if row.fresh:
                tokens.append([firsts[i]])
                logprobs.append([self._pending_logprobs[i]])
            elif row.early:
                tokens.append([])
                logprobs.append([])
            else:
                tokens.append([fed[i]])
                logprobs.append([inputs_logprobs[i]])
            row.tokens += tokens[-1]
            row.early, row.fresh = row.fresh, False
        return tokens, logprobs

    def _emit(self, tokens: list[list[int]], logprobs: list[list[Any]]) -> list[TokenOut]:
        """Each row's tokens through max_tokens and the stop tokens, in order; a row's tokens
        after its finishing one are dropped, and finished rows leave."""
        keep, out = [], []
        for i, row in enumerate(self.rows):
            finish: Literal["stop", "length"] | None = None
            for token, token_logprobs in zip(tokens[i], logprobs[i], strict=True):
                row.generated += 1
                if row.generated >= row.max_tokens:
                    finish = "length"
                if token in self.stop_tokens:
                    finish = "stop"
                cache = self.extract_cache(i) if finish else None
                out.append(TokenOut(row.uid, token, token_logprobs, finish, cache))
                if finish:
                    break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.rows):
            self.filter(keep)
        return out

    def _samplers(self) -> list[Any]:
        return [row.sampler for row in self.rows]

    def _drafts(self) -> list[list[int]] | None:
        """Each row's drafts after its pending token, or None for a plain step. Rows with
        logits processors never draft: their processors see one token at a time."""
        speculator = self.speculator
        if speculator is None or not speculator.active(len(self.rows), self.cache):
            return None
        if any(row.fresh or row.early for row in self.rows):  # between their first two tokens
            return None
        assert self._pending is not None
        # The drafts follow the pending token, so it is needed now (no overlap this step).
        pending = cast(list[int], self._pending.tolist())
        drafts = [
            []
            if row.processors
            # No draft past max_tokens: the pending token is one of them.
            else speculator.propose(
                row.uid, [*row.tokens, pending[i]], row.max_tokens - row.generated - 1
            )
            for i, row in enumerate(self.rows)
        ]
        return drafts if any(drafts) else None

    def _speculative_step(self, drafts: list[list[int]]) -> _Step:
        pending, pending_logprobs = self._pending, self._pending_logprobs
        assert pending is not None
        firsts = cast(list[int], pending.tolist())
        width = 1 + max(len(d) for d in drafts)
        rows = [[t, *d] + [t] * (width - 1 - len(d)) for t, d in zip(firsts, drafts, strict=True)]
        # The whole model: multi-token calls otherwise skip the vocabulary projection.
        model: Any = getattr(self.model, "whole", self.model)
        logits = model(mx.array(rows, dtype=pending.dtype), cache=self.cache)
        first, context = _process(self.rows, logits[:, 0, :], pending)
        if context:
            logits = mx.concatenate([first[:, None, :], logits[:, 1:, :]], axis=1)
        # Sample only each row's pending and draft positions, each with the row's sampler.
        positions = [row * width + j for row, d in enumerate(drafts) for j in range(len(d) + 1)]
        samplers = [
            s for s, d in zip(self._samplers(), drafts, strict=True) for _ in range(len(d) + 1)
        ]
        flat = logits.reshape(-1, logits.shape[-1])[mx.array(positions)]
        sampled_array, sampled_logprobs = sample_rows(flat, samplers)
        mx.eval(sampled_array, _present(sampled_logprobs), context, _present(pending_logprobs))
        sampled = cast(list[int], sampled_array.tolist())

        tokens: list[list[int]] = []
        logprobs: list[list[Any]] = []
        next_tokens, next_logprobs, rejected = [], [], []
        start = 0
        for i, (row, row_drafts) in enumerate(zip(self.rows, drafts, strict=True)):
            count = len(row_drafts)
            kept = accepted_count(row_drafts, sampled[start : start + count])
            tokens.append([firsts[i], *row_drafts[:kept]])
            logprobs.append([pending_logprobs[i], *sampled_logprobs[start : start + kept]])
            next_tokens.append(sampled[start + kept])
            next_logprobs.append(sampled_logprobs[start + kept])
            rejected.append(width - 1 - kept)
            row.tokens += tokens[-1]
            if count and self.speculator is not None:
                self.speculator.record(row.uid, count, kept)
            start += count + 1
        roll_back(self.cache, rejected)
        self._pending = mx.array(next_tokens, dtype=pending.dtype)
        self._pending_logprobs = next_logprobs
        return tokens, logprobs


def _start_contexts(rows: list[Row]) -> None:
    """The token context of each row with logits processors: the tokens its KV holds."""
    for row in rows:
        if row.processors:
            row.context = TokenBuffer(row.tokens)


def _process(rows: list[Row], logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[Any]]:
    """Rows with logits processors through them, each with its token context (fed `inputs`
    first); also the contexts, to evaluate with the step."""
    context: list[mx.array] = []
    if not any(row.processors for row in rows):
        return logits, context
    processed = []
    for i, row in enumerate(rows):
        row_logits = logits[i : i + 1]
        if row.context is not None:
            tokens = row.context.update_and_fetch(inputs[i : i + 1])
            context.append(tokens)
            for processor in row.processors:
                row_logits = processor(tokens, row_logits)
        processed.append(row_logits)
    return mx.concatenate(processed, axis=0), context


def _present(arrays: list[Any]) -> list[mx.array]:
    return [a for a in arrays if a is not None]
