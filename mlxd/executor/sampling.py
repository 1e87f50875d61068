"""Per-sequence samplers and logits processors built from `SamplingParams` with mlx-lm's parts."""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, cast

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import (
    LogitsProcessor,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from mlxd.executor.logsumexp import logsumexp
from mlxd.executor.nucleus import NucleusSampler, TemperatureSampler, argmax, draw
from mlxd.types import SamplingParams, TokenLogprob


class GreedySampler:
    """Argmax, marked so the batched step can skip normalising logits it never reads.

    At temperature 0 the token is the argmax of the raw logits; `logits - logsumexp(logits)`
    over a 49k vocabulary costs ≈1 ms per row on the CPU and only matters when the request asked
    for logprobs. Two shared instances keep same-kind sequences in one batched call.
    """

    def __init__(self, wants_logprobs: bool):
        self.wants_logprobs = wants_logprobs

    def __call__(self, logprobs: mx.array) -> mx.array:
        return argmax(logprobs)


GREEDY = GreedySampler(wants_logprobs=False)
GREEDY_WITH_LOGPROBS = GreedySampler(wants_logprobs=True)


def skips_logprobs(sampler: object) -> bool:
    return isinstance(sampler, GreedySampler) and not sampler.wants_logprobs


class Draw(NamedTuple):
    """A step's next token per row and its normalised log-probabilities per row (None when
    skipped)."""

    tokens: mx.array
    logprobs: list[mx.array | None]


def sample_rows(logits: mx.array, samplers: list) -> Draw:
    """Next token per row and, per row, its normalised log-probabilities (None when skipped).

    All top-p rows (`NucleusSampler`: any temperature, top_p or seed) are drawn in one batched
    call, all temperature-only rows (`TemperatureSampler`) in another; other rows sharing a
    sampler object in one call each. Greedy rows that did not ask
    for logprobs take the argmax of the raw logits (same token: a per-row shift keeps the
    argmax).
    """
    groups: dict[object, list[int]] = {}
    for row, sampler in enumerate(samplers):
        kind = type(sampler) if isinstance(sampler, NucleusSampler) else id(sampler)
        groups.setdefault(kind, []).append(row)
    if len(groups) == 1:
        return _sample_group(logits, samplers)
    pieces: list[mx.array] = []
    logprobs: list[mx.array | None] = [None] * len(samplers)
    order: list[int] = []
    for rows in groups.values():
        group = _sample_group(logits[mx.array(rows)], [samplers[row] for row in rows])
        pieces.append(group.tokens)
        order.extend(rows)
        for row, row_logprobs in zip(rows, group.logprobs, strict=True):
            logprobs[row] = row_logprobs
    inverse = np.argsort(np.array(order))  # back to batch order
    return Draw(mx.concatenate(pieces, axis=0)[mx.array(inverse)], logprobs)


def _sample_group(logits: mx.array, samplers: list) -> Draw:
    sampler = samplers[0]
    if skips_logprobs(sampler):
        return Draw(argmax(logits), [None] * len(samplers))
    if isinstance(sampler, NucleusSampler):
        tokens = draw(logits, samplers)
        wanted = [s.wants_logprobs for s in samplers]
        normalised = logits - logsumexp(logits) if any(wanted) else None
        row_logprobs = [
            normalised[row] if normalised is not None and wants else None
            for row, wants in enumerate(wanted)
        ]
        return Draw(tokens, row_logprobs)
    logprobs = logits - logsumexp(logits)
    return Draw(sampler(logprobs), list(logprobs))


@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    # Sequences holding the *same* sampler object are sampled in one batched call, so unseeded
    # samplers are shared per parameter set.
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


def _seeded_sampler(temperature: float, top_p: float, min_p: float, top_k: int, seed: int):
    key = _seed_key(seed)

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


def _seed_key(seed: int) -> mx.array:
    return mx.random.key(seed % 2**64)  # mlx takes uint64 only; negative seeds wrap


def _nucleus_only(top_p: float, min_p: float, top_k: int) -> bool:
    """Top-p without min-p or top-k: the common non-greedy request, drawn by
    executor/nucleus.py (on the CPU without sorting the vocabulary) instead of mlx-lm's chain."""
    return 0 < top_p < 1.0 and min_p == 0.0 and top_k == 0


def make_sequence_sampler(params: SamplingParams, vocab_size: int) -> Sampler:
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    if params.temperature == 0:
        return GREEDY if params.top_logprobs is None else GREEDY_WITH_LOGPROBS
    # Their own objects: every top-p or temperature-only row is drawn in one batched call
    # anyway (sample_rows).
    key = None if params.seed is None else _seed_key(params.seed)
    wants_logprobs = params.top_logprobs is not None
    if _nucleus_only(params.top_p, params.min_p, top_k):
        return NucleusSampler(params.temperature, params.top_p, key, wants_logprobs)
    if params.min_p == 0.0 and top_k == 0 and not 0 < params.top_p < 1.0:
        return TemperatureSampler(params.temperature, key, wants_logprobs)
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
