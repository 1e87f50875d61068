"""Prompt chunks without the vocabulary projection, and a prompt's last chunk with it once.

mlx-lm's batched prompt processing calls the model on each prompt chunk only to fill the KV
cache and discards the logits. With a 49k-token vocabulary the lm_head over every prompt token
is about a quarter of prefill time (measured on SmolLM2: 11.3 s → 7.2 s for 32x40 tokens on 2
cores), so multi-token calls run the backbone alone. Decode steps (one token) are untouched.

mlx-lm then feeds each prompt's last token in a decode step of its own to get the first
token's logits: one more pass over every weight (≈ 11 ms of a ≈ 40 ms cached-prefix request
on SmolLM2, 2 cores). Where the model's logits are known to be `head(backbone(x))`,
`last_logits` runs the last chunk with the last token in it and projects only each row's last
position, as llama.cpp does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# mlx-lm architectures whose `Model.__call__` is exactly `head(self.model(inputs, cache))`,
# the head being `lm_head` or, with tied embeddings, `model.embed_tokens.as_linear` (read in
# their sources: no logit scaling or soft-capping after it). Others keep mlx-lm's decode step.
HEAD_AFTER_BACKBONE = frozenset(
    f"mlx_lm.models.{name}" for name in ("llama", "qwen2", "qwen3", "phi3", "smollm3")
)


class SkipPrefillLogits:
    """Wraps an mlx-lm model; attribute access goes to the model (layers, make_cache, …)."""

    # Called with the batch's sequence ids before each forward pass (multi-LoRA routing).
    route_rows: Callable[[list[int]], None] | None = None

    def __init__(self, model: nn.Module):
        self._model = model
        self.whole = model  # for callers that need every position's logits (speculation)
        # A model may name its own backbone (a pipeline stage: mlxd/distributed/pipeline.py).
        backbone = getattr(model, "prefill_backbone", None) or getattr(model, "model", None)
        takes_cache = callable(backbone) and "cache" in inspect.signature(backbone).parameters
        self._backbone = backbone if takes_cache else None
        self._head = _output_head(model) if backbone is getattr(model, "model", None) else None

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self._backbone is not None and inputs.shape[1] > 1 and not kwargs:
            return self._backbone(inputs, cache=cache)
        return self._model(inputs, cache=cache, **kwargs)

    @property
    def projects_last(self) -> bool:
        """Whether `last_logits` is available."""
        return self._backbone is not None and self._head is not None

    def last_logits(self, inputs: mx.array, cache: Any, last: mx.array) -> mx.array:
        """Fill the cache with `inputs` (rows × positions) and return the logits at each row's
        position `last[row]` alone (rows × vocabulary)."""
        assert self._backbone is not None and self._head is not None
        hidden = self._backbone(inputs, cache=cache)
        picked = hidden[mx.arange(hidden.shape[0]), last]
        return self._head(picked[:, None, :])[:, 0, :]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _output_head(model: Any) -> Callable[[mx.array], mx.array] | None:
    """The architecture's own head, looked up at each call (adapters may replace it)."""
    if type(model).__module__ not in HEAD_AFTER_BACKBONE:
        return None

    def head(hidden: mx.array) -> mx.array:
        if model.args.tie_word_embeddings:
            return model.model.embed_tokens.as_linear(hidden)
        return model.lm_head(hidden)

    return head
