"""mlx-lm's `BatchGenerator` with a decode step that only computes what was asked for.

mlx-lm's `GenerationBatch._step` normalises every row of the logits (`logits - logsumexp`) and
evaluates every row's log-probabilities each step, for samplers and `logprobs` that most
requests never use. On the CPU backend, over SmolLM2's 49k vocabulary, that is ≈28 ms of a
≈317 ms step at batch 32. Here the step goes through `sampling.sample_rows`: greedy rows that
did not ask for logprobs take the argmax of the raw logits, and only the rows that need
log-probabilities get them. Everything else (caches, processors, stop tokens) is mlx-lm's.

The subclasses hook in where mlx-lm builds its batches: `PromptProcessingBatch.generate`
constructs the `GenerationBatch` (whose first step runs in its constructor), and the
`BatchGenerator` holds one empty batch of each kind that later batches are merged into.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from mlxd.scheduler.sampling import sample_rows


class FastGenerationBatch(GenerationBatch):
    def _step(self) -> tuple[list[int], list[Any]]:
        # Same contract as GenerationBatch._step; rows whose logprobs were skipped hold None.
        _route_rows(self.model, self.uids)
        inputs = self._next_tokens
        # mlx-lm initialises _current_tokens to None, so its inferred type is None alone.
        self._current_tokens = inputs  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs

        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]

        token_context = []
        logits_processors = self.logits_processors or []
        if any(logits_processors):
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
            logits = mx.concatenate(processed, axis=0)

        samplers = (
            [self.fallback_sampler if s is None else s for s in self.samplers]
            if self.samplers
            else [self.fallback_sampler] * len(self.uids)
        )
        self._next_tokens, self._next_logprobs = sample_rows(logits, samplers)
        # Start the next step's compute while this step's tokens are handed out.
        mx.async_eval(self._next_tokens, _present(self._next_logprobs), token_context)

        mx.eval(inputs, _present(self._current_logprobs))
        # A 1-D array's tolist() is a list of ints; the stub types it as any nesting of scalars.
        tokens = cast(list[int], inputs.tolist())
        for sequence_tokens, token in zip(self.tokens, tokens, strict=False):
            sequence_tokens.append(token)
        return tokens, self._current_logprobs


class FastPromptProcessingBatch(PromptProcessingBatch):
    def prompt(self, tokens: list[list[int]]) -> None:
        _route_rows(self.model, self.uids)
        super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> FastGenerationBatch:
        # mlx-lm's generate(), building our GenerationBatch.
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
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
        )
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return generation


class FastBatchGenerator(BatchGenerator):
    def __init__(self, model: Any, **kwargs: Any):
        super().__init__(model, **kwargs)
        # New prompt batches are merged into this one and split off from it (its class is
        # kept by `_copy`), so every GenerationBatch is built by FastPromptProcessingBatch.
        self._prompt_batch.__class__ = FastPromptProcessingBatch
        self._generation_batch = FastGenerationBatch.empty(self.model, self.sampler)


def _route_rows(model: Any, uids: list[int]) -> None:
    """Tell a multi-LoRA model (see engines.core) which sequences the next forward pass's
    rows are, so each row uses its own adapter."""
    route = getattr(model, "route_rows", None)
    if route is not None:
        route(uids)


def _present(arrays: list[Any]) -> list[mx.array]:
    return [a for a in arrays if a is not None]
