"""Top-p (nucleus) sampling of many rows at once from a partial selection of the vocabulary.

mlx-lm's `apply_top_p` sorts every row of the vocabulary, then masks and samples over all of it:
on the CPU backend ≈10 ms a row at a 128k vocabulary and 400 ms for 32 rows (sort alone).
The nucleus of a trained model's distribution is a few dozen tokens (SmolLM2-135M at top_p 0.9:
median 8, at most 702 in 384 steps), so each row's `CANDIDATES` most likely tokens are selected,
only they are sorted, and the token is drawn among them. That is exact when the candidates hold
the nucleus, which is known from their mass: every token outside them is at most the `bound`
(the highest logit left out), so when the candidates above it hold top_p of the mass the
nucleus ends among them (ties at the threshold are kept, as mlx-lm keeps them).

A row whose nucleus reaches further (a flat distribution, such as a random model's) is drawn
again from mlx-lm's full sort, but only once its flag is read: the flags are computed with the
tokens, so checking them costs no wait in the middle of a step (see `Unsettled`).

The selection runs in two stages, as MLX's `argpartition` costs ≈10 ns per element on the CPU:
the maxima of groups of `GROUP` adjacent tokens, then the tokens of the `CANDIDATES` groups with
the highest maxima (they hold the `CANDIDATES` highest tokens: a group without one of them has
its maximum below all of them), partitioned again.

On a GPU the candidates are the whole vocabulary: sorting it is cheap there (mlx_lm.server's
sampled tokens cost ≈ its greedy ones on an H200, docs/performance.md), and a flat row would
otherwise be drawn twice, with a wait between.

All rows go through one batched call: temperature and top_p per row as arrays, and per-row
keys for seeded requests (`mx.vmap` over them), so a seeded row draws the same tokens whatever
rows share its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_top_p

from mlxd.accel import backend_name
from mlxd.executor.logsumexp import exp_below, logsumexp

# Enough for the nucleus of a trained model's distribution at top_p 0.9 (a flat one, such as
# a random model's, takes the fallback).
CANDIDATES = 1024
GROUP = 8


class NucleusSampler:
    """One row's temperature and top-p, as mlx-lm's `make_sampler(temp, top_p)` samples
    (top_p on the untempered log-probabilities, then a categorical draw at the temperature).
    `key` makes it reproducible (a seeded request), else MLX's global random state is used;
    `wants_logprobs`: the request reports log-probabilities, so the step computes them."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        key: mx.array | None = None,
        wants_logprobs: bool = False,
    ):
        self.temperature, self.top_p, self.key = temperature, top_p, key
        self.wants_logprobs = wants_logprobs

    def step_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, step_key = mx.random.split(self.key)
        return step_key

    def __call__(self, logprobs: mx.array) -> mx.array:
        """mlx-lm's sampler protocol: every row of `logprobs` with this sampler, exact at once."""
        tokens, unsettled = draw_nucleus(logprobs, [self] * logprobs.shape[0])
        return settle(tokens, unsettled)


class Unsettled:
    """Nucleus draws whose rows are known exact only once computed: `exact` [n] is False where
    a row's nucleus reached past its candidates; `redraws()` reads it (evaluate it with the
    tokens) and draws those rows again with mlx-lm's full sort and the same step keys."""

    def __init__(
        self,
        exact: mx.array,
        logits: mx.array,
        lse: mx.array,
        samplers: Sequence[NucleusSampler],
        keys: list[mx.array | None],
    ):
        self.exact, self.logits, self.lse = exact, logits, lse
        self.samplers, self.keys = samplers, keys
        self.positions = list(range(len(samplers)))  # each row's position in the whole batch

    def redraws(self) -> dict[int, int]:
        """Batch position → exact token, for the rows whose candidates fell short."""
        if mx.all(self.exact).item():
            return {}
        short = np.flatnonzero(~np.array(self.exact)).tolist()
        samplers = [self.samplers[row] for row in short]
        rows = mx.array(short)
        logprobs = self.logits[rows] - self.lse[rows]
        top_p = mx.array([s.top_p for s in samplers], dtype=mx.float32)[:, None]
        scale = mx.array([1.0 / s.temperature for s in samplers], dtype=mx.float32)[:, None]
        # mlx-lm's rule broadcasts an [n, 1] array of thresholds as it does its float.
        masked = apply_top_p(logprobs, cast(Any, top_p))
        tokens = _categorical(masked * scale, [self.keys[row] for row in short])
        drawn = cast(list[int], tokens.tolist())
        return {self.positions[row]: token for row, token in zip(short, drawn, strict=True)}


def settle(tokens: mx.array, unsettled: Unsettled | None) -> mx.array:
    """`tokens` with the rows `unsettled` flags drawn again: exact, to read now."""
    redrawn = unsettled.redraws() if unsettled is not None else {}
    if not redrawn:
        return tokens
    exact = cast(list[int], tokens.tolist())
    for position, token in redrawn.items():
        exact[position] = token
    return mx.array(exact, dtype=tokens.dtype)


class TemperatureSampler(NucleusSampler):
    """Temperature alone (top_p 1, as mlx-lm's `make_sampler(temp)`): drawn over the whole
    vocabulary from its cumulative tempered weights and one uniform per row, not Gumbel noise
    per token (two `log`s each: ≈16 ms for 32 × 49,152 on the CPU)."""

    def __init__(
        self, temperature: float, key: mx.array | None = None, wants_logprobs: bool = False
    ):
        super().__init__(temperature, 1.0, key, wants_logprobs)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return draw_tempered(logprobs, [self] * logprobs.shape[0])


def draw_tempered(logits: mx.array, samplers: Sequence[NucleusSampler]) -> mx.array:
    """A token per row of `logits` [n, V] with probability softmax(logits / temperature)."""
    scale = mx.array([1.0 / s.temperature for s in samplers], dtype=mx.float32)[:, None]
    tempered = logits.astype(mx.float32) * scale
    cumulative = mx.cumsum(exp_below(tempered, tempered.max(axis=-1, keepdims=True)), axis=-1)
    target = _uniform([s.step_key() for s in samplers]) * cumulative[:, -1:]
    # The first token whose cumulative weight passes the target (a zero weight never does).
    token = (cumulative <= target).sum(axis=-1)
    return mx.minimum(token, logits.shape[-1] - 1).astype(mx.uint32)


class Nucleus(NamedTuple):
    """Per row: the candidates' ids [n, k] in descending order, their log-probabilities (-inf
    outside the top-p nucleus), whether the nucleus ends among them [n] (None: they were the
    whole vocabulary), and the row's log-normaliser [n, 1]."""

    ids: mx.array
    logprobs: mx.array
    exact: mx.array | None
    lse: mx.array


def nucleus_candidates(
    logits: mx.array, top_p: mx.array, candidates: int = CANDIDATES, group: int = GROUP
) -> Nucleus:
    """The top-p nucleus of each row of `logits` [n, V] among its candidates; `top_p` [n, 1]."""
    ids, values, bound = top_candidates(logits, candidates, group)
    lse = logsumexp(logits, top=values[:, :1])  # the first candidate is the row's maximum
    logprobs = values - lse
    probs = mx.exp(logprobs)
    # mlx-lm drops a token when the tokens more likely than it hold top_p of the mass (the
    # whole vocabulary's mass is 1: these are log-probabilities).
    mass_before = mx.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(logprobs, kept - 1, axis=-1)
    masked = mx.where(logprobs < threshold, -mx.inf, logprobs)
    if bound is None:
        return Nucleus(ids, masked, None, lse)
    exact = mx.where(values > bound, probs, 0.0).sum(axis=-1) >= top_p[:, 0]
    return Nucleus(ids, masked, exact, lse)


def draw_nucleus(
    logits: mx.array,
    samplers: Sequence[NucleusSampler],
    candidates: int | None = None,
    group: int = GROUP,
) -> tuple[mx.array, Unsettled | None]:
    """A token per row of `logits` [n, V], row i with `samplers[i]`'s temperature, top_p and
    key; with the check of the rows drawn from candidates (None when they were the whole
    vocabulary). `candidates`: CANDIDATES on the CPU, the whole vocabulary on a GPU."""
    if candidates is None:
        candidates = CANDIDATES if backend_name() == "cpu" else logits.shape[-1]
    top_p = mx.array([s.top_p for s in samplers], dtype=mx.float32)[:, None]
    nucleus = nucleus_candidates(logits, top_p, candidates, group)
    scale = mx.array([1.0 / s.temperature for s in samplers], dtype=mx.float32)[:, None]
    keys = [s.step_key() for s in samplers]
    choice = _categorical(nucleus.logprobs * scale, keys)
    tokens = mx.take_along_axis(nucleus.ids, choice[:, None], axis=-1).squeeze(-1)
    if nucleus.exact is None:
        return tokens, None
    return tokens, Unsettled(nucleus.exact, logits, nucleus.lse, samplers, keys)


def top_candidates(
    logits: mx.array, candidates: int = CANDIDATES, group: int = GROUP
) -> tuple[mx.array, mx.array, mx.array | None]:
    """Per row of `logits` [n, V]: the ids and logits of its `candidates` highest in
    descending order [n, k], and the highest logit left out [n, 1] (None: none was)."""
    rows, vocab = logits.shape
    if vocab <= candidates:
        order = mx.argsort(-logits, axis=-1)
        return order, mx.take_along_axis(logits, order, axis=-1), None
    groups = -(-vocab // group)
    if groups > candidates:
        padded = mx.pad(logits, [(0, 0), (0, groups * group - vocab)], constant_values=-mx.inf)
        maxima = padded.reshape(rows, groups, group).max(axis=-1)
        ranked = mx.argpartition(-maxima, kth=candidates, axis=-1)
        # The groups' tokens; the first group left out bounds every token left out with it.
        chosen = ranked[:, :candidates, None] * group + mx.arange(group, dtype=ranked.dtype)
        ids = chosen.reshape(rows, candidates * group)
        values = mx.take_along_axis(padded, ids, axis=-1)
        bound = mx.take_along_axis(maxima, ranked[:, candidates:][:, :1], axis=-1)
    else:  # a vocabulary of a few thousand: one stage
        ids = mx.broadcast_to(mx.arange(vocab, dtype=mx.uint32), (rows, vocab))
        values, bound = logits, None
    ranked = mx.argpartition(-values, kth=candidates, axis=-1)
    left_out = mx.take_along_axis(values, ranked[:, candidates:][:, :1], axis=-1)
    bound = left_out if bound is None else mx.maximum(bound, left_out)
    ranked = ranked[:, :candidates]
    values = mx.take_along_axis(values, ranked, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(mx.take_along_axis(ids, ranked, axis=-1), order, axis=-1)
    return ids, mx.take_along_axis(values, order, axis=-1), bound


def _categorical(logits: mx.array, keys: list[mx.array | None]) -> mx.array:
    """A categorical draw per row: from MLX's global random state, or the row's own key."""
    by_key = mx.vmap(lambda row, key: mx.random.categorical(row, key=key))
    return _per_row(
        keys,
        lambda rows: mx.random.categorical(logits if rows is None else logits[rows]),
        lambda rows, stacked: by_key(logits if rows is None else logits[rows], stacked),
    )


def _uniform(keys: list[mx.array | None]) -> mx.array:
    """A uniform draw in [0, 1) per row [n, 1], from the global state or the row's own key."""
    by_key = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))
    return _per_row(
        keys,
        lambda rows: mx.random.uniform(shape=(len(keys) if rows is None else rows.size, 1)),
        lambda rows, stacked: by_key(stacked),
    )


def _per_row(
    keys: list[mx.array | None],
    from_state: Callable[[mx.array | None], mx.array],
    from_keys: Callable[[mx.array | None, mx.array], mx.array],
) -> mx.array:
    """A draw per row in batch order: `from_state(rows)` for the rows without a key (None: all
    rows), `from_keys(rows, keys)` for the seeded rows with their stacked keys."""
    own_keys = {i: key for i, key in enumerate(keys) if key is not None}
    if not own_keys:
        return from_state(None)
    stacked = mx.stack(list(own_keys.values()))
    if len(own_keys) == len(keys):
        return from_keys(None, stacked)
    seeded = list(own_keys)
    unseeded = [i for i, key in enumerate(keys) if key is None]
    drawn = mx.concatenate([from_keys(mx.array(seeded), stacked), from_state(mx.array(unseeded))])
    return drawn[mx.array(np.argsort(seeded + unseeded))]
