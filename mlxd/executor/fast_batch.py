"""mlx-lm's prompt and generation batches with a decode step that only computes what was asked for.

mlx-lm's `GenerationBatch._step` normalises every row of the logits (`logits - logsumexp`) and
evaluates every row's log-probabilities each step, for samplers and `logprobs` that most
requests never use. On the CPU backend, over SmolLM2's 49k vocabulary, that is ≈28 ms of a
≈317 ms step at batch 32. Here the step goes through `sampling.sample_rows`: greedy rows that
did not ask for logprobs take the argmax of the raw logits, and only the rows that need
log-probabilities get them. Everything else (caches, processors, stop tokens) is mlx-lm's.
With a speculator (see speculative.py) a step may verify drafts and give a row several tokens;
`next` then passes each through max_tokens and the stop tokens in order.

mlx-lm pipelines: a step hands out the previous step's tokens once it has started its own.
On the CPU, MLX's `async_eval` returns only once all but the last few ops of the graph have
run (its scheduler caps the tasks in flight), so a first token came out a whole step after it
was computed. Here a row's first token is handed out by the step that computes it (`_start`,
`_fresh`); from its second token on the row is pipelined again, which is faster at batch 1
(measured: handing every token out at once lost ≈25% of the batch-1 throughput).

Where the model projects last positions alone (`SkipPrefillLogits.projects_last`), a
prompt's last chunk takes its last token along and the first token is sampled from that
prefill (`FastPromptProcessingBatch.start`): no decode step of its own for the last prompt
token, as in llama.cpp. Otherwise prompts join the decode batch one step sooner than in
mlx-lm (`executor.batch.BatchExecutor.run`). The KV copies around a prefill cover the positions in
use rather than whole allocations (`finalize_used_span`, `FastGenerationBatch.extend`): both
shorten the time to a first token when prompts arrive while others decode.

The subclasses hook in where mlx-lm builds its batches: `PromptProcessingBatch.generate`
constructs the `GenerationBatch` (whose first step runs in its constructor). Which rows run
when is `executor.batch.BatchExecutor`'s, as the scheduler planned it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.executor.sampling import sample_rows
from mlxd.executor.speculative import Speculator, accepted_count, roll_back


class FastGenerationBatch(GenerationBatch):
    # Set on the generator's long-lived batch when the model speculates (see speculative.py).
    speculator: Speculator[Any] | None = None

    def __init__(self, *args: Any, first_logits: mx.array | None = None, **kwargs: Any):
        """`first_logits`: each row's logits after its whole prompt, when the prefill computed
        them (`FastPromptProcessingBatch.start`); the first tokens are sampled from them."""
        # Per row: admitted and its first token not computed yet; its first token went out
        # with the step that computed it, so the token the next step feeds is out already.
        self._fresh: list[bool] = []
        self._early: list[bool] = []
        # Every row's first token is computed and not handed out yet (see _hand_out).
        self._ready = False
        self._first_logits = first_logits
        self._constructing = True  # mlx-lm's constructor runs a first step: see _start
        super().__init__(*args, **kwargs)
        self._constructing = False
        self._first_logits = None

    # Rows may emit several tokens now; `next` below is the only caller that reads them.
    def _step(self) -> tuple[list[list[int]], list[list[Any]]]:  # type: ignore[override]
        """Each row's tokens this step (none, one, or more when drafts were accepted) and,
        per token, its log-probabilities (None where skipped)."""
        _route_rows(self.model, self.uids)
        if self._constructing:
            return self._start()
        if self._ready:
            return self._hand_out()
        drafts = self._drafts()
        if drafts is not None:
            return self._speculative_step(drafts)
        inputs = self._next_tokens
        # mlx-lm initialises _current_tokens to None, so its inferred type is None alone.
        self._current_tokens = inputs  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs

        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        logits, token_context = self._process(logits, inputs)
        self._next_tokens, self._next_logprobs = sample_rows(logits, self._samplers())
        computed = [self._next_tokens, _present(self._next_logprobs), token_context]
        if any(self._fresh):
            mx.eval(*computed)  # first tokens go out now
            firsts = cast(list[int], self._next_tokens.tolist())
        else:
            # Start the next step's compute while this step's tokens are handed out.
            mx.async_eval(*computed)
            firsts = []
        mx.eval(inputs, _present(self._current_logprobs))
        # A 1-D array's tolist() is a list of ints; the stub types it as any nesting of scalars.
        fed = cast(list[int], inputs.tolist())
        tokens: list[list[int]] = []
        logprobs: list[list[Any]] = []
        for row in range(len(self.uids)):
            if self._fresh[row]:
                tokens.append([firsts[row]])
                logprobs.append([self._next_logprobs[row]])
            elif self._early[row]:
                tokens.append([])
                logprobs.append([])
            else:
                tokens.append([fed[row]])
                logprobs.append([self._current_logprobs[row]])
            self.tokens[row].extend(tokens[-1])
        self._early, self._fresh = self._fresh, [False] * len(self.uids)
        return tokens, logprobs

    def _start(self) -> tuple[list[list[int]], list[list[Any]]]:
        """The step mlx-lm's constructor runs, which would compute each row's first token
        and hand out (to nobody) the prompt's last one. Without first logits nothing is
        computed here: the batch's next step computes the first tokens and hands them out at
        once. With them, the first tokens are sampled now and the next step hands them out."""
        rows = len(self.uids)
        inputs = self._next_tokens
        self._current_tokens = inputs  # type: ignore[assignment]
        self._next_logprobs = [None] * rows
        self._fresh, self._early = [True] * rows, [False] * rows
        last = cast(list[int], inputs.tolist())
        for sequence_tokens, token in zip(self.tokens, last, strict=True):
            sequence_tokens.append(token)
        if self._first_logits is not None:
            logits, token_context = self._process(self._first_logits, inputs)
            self._next_tokens, self._next_logprobs = sample_rows(logits, self._samplers())
            mx.eval(self._next_tokens, _present(self._next_logprobs), token_context)
            self._fresh, self._ready = [False] * rows, True
        return [[t] for t in last], [[None] for _ in last]

    def _hand_out(self) -> tuple[list[list[int]], list[list[Any]]]:
        """The first tokens sampled from the prefill's logits, computing nothing; the next
        step feeds them (they are out already, as a fresh row's are)."""
        firsts = cast(list[int], self._next_tokens.tolist())
        for sequence_tokens, token in zip(self.tokens, firsts, strict=True):
            sequence_tokens.append(token)
        self._ready, self._early = False, [True] * len(self.uids)
        return [[t] for t in firsts], [[lp] for lp in self._next_logprobs]

    def extend(self, batch: GenerationBatch) -> None:
        # mlx-lm pads both batches' KV buffers to the larger allocation and concatenates
        # them: copy the positions in use and the allocation step they are in, no more.
        for cache in [*self.prompt_cache, *batch.prompt_cache]:
            if isinstance(cache, BatchKVCache):
                _trim(cache, (cache.size() // cache.step + 1) * cache.step)
        super().extend(batch)
        joining = cast(FastGenerationBatch, batch)  # every batch here is built by generate()
        self._fresh += joining._fresh
        self._early += joining._early

    def extract_cache(self, idx: int) -> list[Any]:
        """mlx-lm copies the row's whole KV out of the batch (`mx.contiguous`) for a caller
        that keeps it. mlxd's one caller, the prefix cache's store, copies the blocks it
        keeps and lets the rest go at once, so a row of plain KV is handed out as a view:
        ≈ 17 ms and 70 MB not copied after a 1,600-token prompt on SmolLM2."""
        return [
            _row_view(cache, idx) if type(cache) is BatchKVCache else cache.extract(idx)
            for cache in self.prompt_cache
        ]

    def _samplers(self) -> list[Any]:
        if not self.samplers:
            return [self.fallback_sampler] * len(self.uids)
        return [self.fallback_sampler if s is None else s for s in self.samplers]

    def _process(self, logits: mx.array, inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Rows with logits processors through them (each with its token context)."""
        token_context: list[mx.array] = []
        logits_processors = self.logits_processors or []
        if not any(logits_processors):
            return logits, token_context
        processed = []
        for row in range(len(self.uids)):
            row_logits = logits[row : row + 1]
            processors = logits_processors[row] or ()
            if processors:
                context = self._token_context[row].update_and_fetch(inputs[row : row + 1])
                token_context.append(context)
                for processor in processors:
                    row_logits = processor(context, row_logits)
            processed.append(row_logits)
        return mx.concatenate(processed, axis=0), token_context

    def _drafts(self) -> list[list[int]] | None:
        """Each row's drafts after its pending token, or None for a plain step. Rows with
        logits processors never draft: their processors see one token at a time."""
        speculator = self.speculator
        if speculator is None or not speculator.active(len(self.uids), self.prompt_cache):
            return None
        if any(self._fresh) or any(self._early):  # rows between their first two tokens
            return None
        # The drafts follow the pending token, so it is needed now (no overlap this step).
        pending = cast(list[int], self._next_tokens.tolist())
        processors = self.logits_processors or [[]] * len(self.uids)
        drafts = [
            []
            if processors[row]
            # No draft past max_tokens: the pending token is one of them.
            else speculator.propose(
                self.uids[row],
                self.tokens[row] + [pending[row]],
                self.max_tokens[row] - self._num_tokens[row] - 1,
            )
            for row in range(len(self.uids))
        ]
        return drafts if any(drafts) else None

    def _speculative_step(self, drafts: list[list[int]]) -> tuple[list[list[int]], list[list[Any]]]:
        pending = self._next_tokens
        self._current_tokens = pending  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        firsts = cast(list[int], pending.tolist())
        width = 1 + max(len(d) for d in drafts)
        rows = [[t, *d] + [t] * (width - 1 - len(d)) for t, d in zip(firsts, drafts, strict=True)]
        # The whole model: multi-token calls otherwise skip the vocabulary projection.
        model: Any = getattr(self.model, "whole", self.model)
        logits = model(mx.array(rows, dtype=pending.dtype), cache=self.prompt_cache)
        first, token_context = self._process(logits[:, 0, :], pending)
        if token_context:
            logits = mx.concatenate([first[:, None, :], logits[:, 1:, :]], axis=1)
        # Sample only each row's pending and draft positions, each with the row's sampler.
        positions = [row * width + j for row, d in enumerate(drafts) for j in range(len(d) + 1)]
        samplers = [
            s for s, d in zip(self._samplers(), drafts, strict=True) for _ in range(len(d) + 1)
        ]
        flat = logits.reshape(-1, logits.shape[-1])[mx.array(positions)]
        sampled_array, sampled_logprobs = sample_rows(flat, samplers)
        mx.eval(
            sampled_array,
            _present(sampled_logprobs),
            token_context,
            _present(self._current_logprobs),
        )
        sampled = cast(list[int], sampled_array.tolist())

        tokens: list[list[int]] = []
        logprobs: list[list[Any]] = []
        next_tokens, next_logprobs, rejected = [], [], []
        start = 0
        for row, row_drafts in enumerate(drafts):
            count = len(row_drafts)
            kept = accepted_count(row_drafts, sampled[start : start + count])
            tokens.append([firsts[row], *row_drafts[:kept]])
            logprobs.append([self._current_logprobs[row], *sampled_logprobs[start : start + kept]])
            next_tokens.append(sampled[start + kept])
            next_logprobs.append(sampled_logprobs[start + kept])
            rejected.append(width - 1 - kept)
            self.tokens[row].extend(tokens[-1])
            if count and self.speculator is not None:
                self.speculator.record(self.uids[row], count, kept)
            start += count + 1
        roll_back(self.prompt_cache, rejected)
        self._next_tokens = mx.array(next_tokens, dtype=pending.dtype)
        self._next_logprobs = next_logprobs
        return tokens, logprobs

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._fresh = [self._fresh[row] for row in keep]
        self._early = [self._early[row] for row in keep]
        if self.speculator is not None:  # free what it keeps for the rows that left
            self.speculator.retain(self.uids)

    def next(self) -> list[GenerationBatch.Response]:
        """mlx-lm's `next` for rows that may emit several tokens: each goes through max_tokens
        and the stop tokens in order; a row's tokens after its finishing one are dropped."""
        if not self.uids:
            return []
        tokens, logprobs = self._step()
        if not any(tokens):  # every row between its first two tokens: no empty answer
            tokens, logprobs = self._step()
        keep, responses = [], []
        for row, uid in enumerate(self.uids):
            finish = None
            for token, token_logprobs in zip(tokens[row], logprobs[row], strict=True):
                self._num_tokens[row] += 1
                if self._num_tokens[row] >= self.max_tokens[row]:
                    finish = "length"
                if self._matchers[row].advance(token):
                    finish = "stop"
                responses.append(
                    self.Response(
                        uid=uid,
                        token=token,
                        logprobs=token_logprobs,
                        finish_reason=finish,
                        prompt_cache=self.extract_cache(row) if finish else None,
                        all_tokens=self.tokens[row] if finish else None,
                    )
                )
                if finish:
                    break
            if finish is None:
                keep.append(row)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def finalize_used_span(cache: Any) -> None:
    """`cache.finalize()` at the end of a prefill of prompts of different lengths
    (right-padded, then rolled to left padding), rolling only the positions in use of a plain
    batch KV cache. mlx-lm rolls the whole buffer, allocated 256 positions at a time, with a
    single-threaded gather: 52 ms after a 156 ms prefill of ten short prompts on SmolLM2.
    Only here: speculation's rollback (speculative.roll_back) keeps the buffer's room, and
    trimmed, the next write would copy the whole cache."""
    if type(cache) is BatchKVCache:
        _trim(cache, cache.size())
    cache.finalize()


def _row_view(cache: BatchKVCache, idx: int) -> KVCache:
    """`BatchKVCache.extract` without its copy."""
    assert cache.keys is not None and cache.values is not None  # a row in a batch has KV
    row = KVCache()
    padding = cast(int, cache.left_padding[idx].item())
    end = cache.size()
    row.keys = cache.keys[idx : idx + 1, :, padding:end]
    row.values = cache.values[idx : idx + 1, :, padding:end]
    row.offset = end - padding
    return row


def _trim(cache: BatchKVCache, size: int) -> None:
    """Keep the first `size` allocated positions, at least all those written (a write past
    the end allocates more)."""
    if cache.keys is not None and cache.keys.shape[2] > size >= cache.size():
        cache.keys = cache.keys[..., :size, :]
        cache.values = cache.values[..., :size, :]


class FastPromptProcessingBatch(PromptProcessingBatch):
    def split(self, indices: list[int]) -> PromptProcessingBatch:
        """mlx-lm deep-copies the batch (its whole KV cache) and filters both halves, which
        copies the cache again; when every sequence moves on to generation, as when prompts
        end together, the batch moves as it is and an empty one stays."""
        if sorted(indices) != list(range(len(self.uids))):
            return super().split(indices)
        moved = copy.copy(self)
        self.prompt_cache = []  # filter([]) clears it in place, and `moved` shares it
        self.filter([])
        return moved

    def prompt(self, tokens: list[list[int]]) -> None:
        """mlx-lm's prompt processing (forward passes of at most `prefill_step_size`
        positions), rolling only the positions in use after a right-padded prefill."""
        _route_rows(self.model, self.uids)
        for held, chunk in zip(self.tokens, tokens, strict=True):
            held += chunk  # the tokens the KV cache holds
        with self._right_padded(tokens) as inputs:
            while inputs.shape[1] > 0:
                self.model(inputs[:, : self.prefill_step_size], cache=self.prompt_cache)
                mx.eval([cache.state for cache in self.prompt_cache])
                mx.clear_cache()
                inputs = inputs[:, self.prefill_step_size :]
        mx.eval([cache.state for cache in self.prompt_cache])  # the roll to left padding

    def generate(self, tokens: list[list[int]]) -> FastGenerationBatch:
        # mlx-lm's generate(), building our GenerationBatch.
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        return self._generation(tokens)

    def start(self, tokens: list[list[int]]) -> FastGenerationBatch:
        """`generate` with the last prompt tokens in the prefill's forward pass (the model
        must project only the last positions: `SkipPrefillLogits.projects_last`): the batch
        starts with its first tokens sampled. Each row's `tokens` fit one prefill step."""
        _route_rows(self.model, self.uids)
        for held, rest in zip(self.tokens, tokens, strict=True):
            held += rest[:-1]  # as prompt() keeps them; the batch adds the last one
        last = mx.array([len(t) for t in tokens]) - 1
        with self._right_padded(tokens) as inputs:
            logits = cast(Any, self.model).last_logits(inputs, self.prompt_cache, last)
        mx.eval(logits, [cache.state for cache in self.prompt_cache])
        return self._generation(tokens, logits)

    def _generation(
        self, tokens: list[list[int]], first_logits: mx.array | None = None
    ) -> FastGenerationBatch:
        generation = FastGenerationBatch(
            self.model,
            self.uids,
            mx.array([t[-1] for t in tokens]),
            self.prompt_cache,
            self.tokens,
            self.samplers,
            self.fallback_sampler,
            self.logits_processors,
            self.stop_sequences,
            self.max_tokens,
            first_logits=first_logits,
        )
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation

    @contextlib.contextmanager
    def _right_padded(self, tokens: list[list[int]]) -> Iterator[mx.array]:
        """The rows' tokens as one array for forward passes in the block: prompts of
        different lengths are right-padded, and rolled to left padding after the block."""
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        padding = [width - length for length in lengths]
        if any(padding):
            for cache in self.prompt_cache:
                cache.prepare(lengths=lengths, right_padding=padding)
        yield mx.array([t + [0] * (width - len(t)) for t in tokens])
        if any(padding):
            for cache in self.prompt_cache:
                finalize_used_span(cache)


def _route_rows(model: Any, uids: list[int]) -> None:
    """Tell a multi-LoRA model (see engines.core) which sequences the next forward pass's
    rows are, so each row uses its own adapter."""
    route = getattr(model, "route_rows", None)
    if route is not None:
        route(uids)


def _present(arrays: list[Any]) -> list[mx.array]:
    return [a for a in arrays if a is not None]
