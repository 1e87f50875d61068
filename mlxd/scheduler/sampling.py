"""Per-sequence samplers and logits processors built from `SamplingParams` with mlx-lm's parts."""

from __future__ import annotations

from functools import lru_cache
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import (
    LogitsProcessor,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlxd.types import SamplingParams, TokenLogprob


@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    # Sequences holding the *same* sampler object are sampled in one batched call by
    # mlx-lm's GenerationBatch, so unseeded samplers are shared per parameter set.
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


def _seeded_sampler(temperature: float, top_p: float, min_p: float, top_k: int, seed: int):
    key = mx.random.key(seed % 2**64)  # mlx takes uint64 only; negative seeds wrap

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, step_key = mx.random.split(key)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0.0:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        return mx.random.categorical(logprobs * (1.0 / temperature), key=step_key)

    return sample


def make_sequence_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    if params.temperature == 0:
        return _shared_sampler(0.0, 1.0, 0.0, 0)
    if params.seed is not None:
        return _seeded_sampler(params.temperature, params.top_p, params.min_p, top_k, params.seed)
    return _shared_sampler(params.temperature, params.top_p, params.min_p, top_k)


def make_sequence_processors(params: SamplingParams, max_tokens: int) -> list[LogitsProcessor]:
    # OpenAI applies presence/frequency penalties over everything generated so far; the
    # repetition penalty too, unless the request narrows it (repetition_context_size, as
    # mlx-lm's and swift-mlx-server's APIs take it).
    return make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=params.repetition_context_size or max_tokens,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=max_tokens,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=max_tokens,
    )


def token_logprob(logprobs: mx.array, token: int, top: int, decode) -> TokenLogprob:
    """The sampled token's log-probability and, when asked, the `top` most likely tokens."""
    # mlx types item() as any scalar and tolist() as any nesting: here floats, flat lists.
    chosen = cast(float, logprobs[token].item())
    alternatives: list[tuple[str, float]] = []
    if top > 0:
        ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        top_ids = cast(list[int], ids[order].tolist())
        top_values = cast(list[float], values[order].tolist())
        alternatives = [(decode(i), v) for i, v in zip(top_ids, top_values, strict=True)]
    return TokenLogprob(token=decode(token), logprob=chosen, top=alternatives)
