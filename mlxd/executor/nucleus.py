"""Top-p (nucleus) and temperature sampling of many rows at once.

On the CPU backend, with mlxd's kernels built, every row is drawn by one kernel
(`mlxd.kernels.sample`, csrc/sampling_kernel.cpp): the nucleus of mlx-lm's `apply_top_p` from a
histogram of the row's mass instead of a sort, then the first kept token whose cumulative
tempered weight passes the row's uniform draw; a few passes over the logits, exact, one lazy
graph node. As MLX graph code the same draw took ≈15 element-wise passes, a partial selection of
candidates, and for a flat row (a random model's) a second draw from a full sort.

Elsewhere (a GPU, or a CPU without the kernels) the draw is MLX graph code: temperature alone
from the cumulative tempered weights and one uniform per row; top-p from a sort of the whole
vocabulary, as mlx-lm's `apply_top_p` sorts it (cheap on a GPU: mlx_lm.server's sampled tokens
cost ≈ its greedy ones on an H200, docs/performance.md), and a categorical draw among it.

All rows go through one batched call: temperature and top_p per row as arrays, and per-row
keys for seeded requests (`mx.vmap` over them), so a seeded row draws the same tokens whatever
rows share its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlxd import kernels
from mlxd.accel import backend_name
from mlxd.executor.logsumexp import exp_below, logsumexp


class NucleusSampler:
    """One row's temperature and top-p, as mlx-lm's `make_sampler(temp, top_p)` samples
    (top_p on the untempered log-probabilities, then a draw at the temperature).
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
        """mlx-lm's sampler protocol: every row of `logprobs` with this sampler."""
        return draw(logprobs, [self] * logprobs.shape[0])


class TemperatureSampler(NucleusSampler):
    """Temperature alone (top_p 1, as mlx-lm's `make_sampler(temp)`): drawn over the whole
    vocabulary from its cumulative tempered weights and one uniform per row, not Gumbel noise
    per token (two `log`s each: ≈16 ms for 32 × 49,152 on the CPU)."""

    def __init__(
        self, temperature: float, key: mx.array | None = None, wants_logprobs: bool = False
    ):
        super().__init__(temperature, 1.0, key, wants_logprobs)


def draw(logits: mx.array, samplers: Sequence[NucleusSampler]) -> mx.array:
    """A token per row of `logits` [n, V] (uint32), row i with `samplers[i]`'s temperature,
    top_p and key: mlxd's kernel on the CPU, else temperature alone when no row has a top_p
    below 1 (a batch of `TemperatureSampler`s), else the nucleus from a full sort."""
    keys = [s.step_key() for s in samplers]
    scale = mx.array([1.0 / s.temperature for s in samplers], dtype=mx.float32)
    top_p = mx.array([s.top_p for s in samplers], dtype=mx.float32)
    if native():
        return kernels.sample(logits, scale, top_p, _uniform(keys)[:, 0])
    if all(s.top_p >= 1.0 for s in samplers):
        return _draw_tempered(logits, scale[:, None], keys)
    nucleus = nucleus_of(logits, top_p[:, None])
    choice = _categorical(nucleus.logprobs * scale[:, None], keys)
    return mx.take_along_axis(nucleus.ids, choice[:, None], axis=-1).squeeze(-1)


def argmax(logits: mx.array) -> mx.array:
    """The token of each row of `logits` [n, V] at temperature 0: mlxd's kernel on the CPU (a
    vectorised pass on every core), else `mx.argmax`; the first of equal maxima either way."""
    if native() and logits.ndim == 2:
        return kernels.argmax(logits)
    return mx.argmax(logits, axis=-1)


def native() -> bool:
    """Whether rows are drawn by mlxd's CPU kernel (the CPU backend, the kernels built)."""
    return backend_name() == "cpu" and kernels.available()


def _draw_tempered(logits: mx.array, scale: mx.array, keys: list[mx.array | None]) -> mx.array:
    """A token per row of `logits` [n, V] with probability softmax(logits · scale [n, 1])."""
    tempered = logits.astype(mx.float32) * scale
    cumulative = mx.cumsum(exp_below(tempered, tempered.max(axis=-1, keepdims=True)), axis=-1)
    target = _uniform(keys) * cumulative[:, -1:]
    # The first token whose cumulative weight passes the target (a zero weight never does).
    token = (cumulative <= target).sum(axis=-1)
    return mx.minimum(token, logits.shape[-1] - 1).astype(mx.uint32)


class Nucleus(NamedTuple):
    """Per row: the vocabulary's ids [n, V] in descending order of logit and their
    log-probabilities, -inf outside the top-p nucleus."""

    ids: mx.array
    logprobs: mx.array


def nucleus_of(logits: mx.array, top_p: mx.array) -> Nucleus:
    """The top-p nucleus of each row of `logits` [n, V] from a sort; `top_p` [n, 1]."""
    ids = mx.argsort(-logits, axis=-1)
    values = mx.take_along_axis(logits, ids, axis=-1)
    logprobs = values - logsumexp(logits, top=values[:, :1])
    probs = mx.exp(logprobs)
    # mlx-lm drops a token when the tokens more likely than it hold top_p of the mass (the
    # whole vocabulary's mass is 1: these are log-probabilities).
    mass_before = mx.cumsum(probs, axis=-1) - probs
    kept = (mass_before < top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(logprobs, kept - 1, axis=-1)
    return Nucleus(ids, mx.where(logprobs < threshold, -mx.inf, logprobs))


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
