"""Top-p (nucleus) sampling from a partial selection instead of a sort of the vocabulary.

mlx-lm's `apply_top_p` sorts every row of the vocabulary, then masks and samples over all of it:
on the CPU backend ≈10 ms a row at a 128k vocabulary and 400 ms for 32 rows (sort alone).
The nucleus of a trained model's distribution is a few dozen tokens, so here each row's
`CANDIDATES` most likely tokens are selected (`mx.argpartition`, linear), only they are
sorted, and the token is drawn among them. That is exact: a token outside the candidates is
in the nucleus only when the candidates' mass falls short of `top_p`, and then the step falls
back to mlx-lm's full sort. Ties at the threshold are kept, as mlx-lm keeps them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

# Enough for the nucleus of any trained model's distribution at top_p 0.9 (a flat one, such as
# a random model's, takes the fallback); selecting them costs about as much as one exp over
# the vocabulary.
CANDIDATES = 1024


def nucleus_candidates(
    logprobs: mx.array, top_p: float, candidates: int = CANDIDATES
) -> tuple[mx.array, mx.array] | None:
    """Per row of normalised `logprobs` [B, V]: the candidates' ids and their log-probabilities
    in descending order [B, k], -inf where a candidate is outside the top-p nucleus; None when
    some row's nucleus reaches beyond the candidates (then only a full sort is exact).
    """
    k = min(candidates, logprobs.shape[-1])
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1)
    values = mx.take_along_axis(values, order, axis=-1)
    probs = mx.exp(values.astype(mx.float32))
    # mlx-lm drops a token when the tokens more likely than it hold top_p of the mass (the
    # whole vocabulary's mass is 1: these are log-probabilities).
    mass_before = mx.cumsum(probs, axis=-1) - probs
    if k < logprobs.shape[-1] and not mx.all(mass_before[..., -1] + probs[..., -1] >= top_p):
        return None
    kept = (mass_before < top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(values, kept - 1, axis=-1)
    return ids, mx.where(values < threshold, -mx.inf, values)


class NucleusSampler:
    """Temperature plus top-p, as mlx-lm's `make_sampler(temp, top_p)` samples (top_p on the
    untempered log-probabilities, then a categorical draw at the temperature); `key` makes
    it reproducible (a seeded request), else MLX's global random state is used."""

    def __init__(self, temperature: float, top_p: float, key: mx.array | None = None):
        self.temperature, self.top_p, self.key = temperature, top_p, key

    def _step_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, step_key = mx.random.split(self.key)
        return step_key

    def __call__(self, logprobs: mx.array) -> mx.array:
        step_key = self._step_key()
        scale = 1.0 / self.temperature
        nucleus = nucleus_candidates(logprobs, self.top_p)
        if nucleus is None:
            masked = apply_top_p(logprobs, self.top_p)
            return mx.random.categorical(masked * scale, key=step_key)
        ids, values = nucleus
        choice = mx.random.categorical(values * scale, key=step_key)
        return mx.take_along_axis(ids, choice[..., None], axis=-1).squeeze(-1)
