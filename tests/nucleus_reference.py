"""The draw mlxd's sampling kernel makes (csrc/sampling_kernel.cpp), in float64: mlx-lm's top-p
nucleus of the untempered distribution, then the first kept token in index order whose
cumulative tempered weight passes u of their total. A draw is `sure` when no boundary lies
within EPSILON of the row's mass or weight: float32 arithmetic in another order may decide
otherwise only there."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

EPSILON = 1e-6


class Expected(NamedTuple):
    token: int
    sure: bool
    # The tokens a draw within EPSILON of a boundary may give: the nucleus with EPSILON of slack.
    allowed: np.ndarray


def nucleus(row: np.ndarray, top_p: float, slack: float = 0.0) -> np.ndarray:
    """mlx-lm's nucleus of logits `row` as a mask: a token is kept when the tokens with higher
    logits hold less than top_p (+ slack) of the mass, so ties at the threshold are all kept."""
    x = row.astype(np.float64)
    if top_p >= 1.0:
        return np.ones(x.shape, bool)
    probs = np.exp(x - x.max())
    order = np.argsort(-x, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    ties = np.searchsorted(-x[order], -x[order], side="left")  # each token's first equal
    kept = np.empty(x.shape, bool)
    kept[order] = before[ties] < (top_p + slack) * probs.sum()
    return kept


def draws(
    row: np.ndarray, inv_temperature: float, top_p: float, uniforms: list[float]
) -> list[Expected]:
    """The token drawn from logits `row` for each uniform."""
    x = row.astype(np.float64)
    kept = nucleus(row, top_p)
    loose = nucleus(row, top_p, EPSILON)
    settled = bool((kept == nucleus(row, top_p, -EPSILON)).all())
    weights = np.where(kept, np.exp((x - x.max()) * inv_temperature), 0.0)
    cumulative = np.cumsum(weights)
    total = cumulative[-1]
    out = []
    for u in uniforms:
        target = u * total
        token = int(np.argmax(cumulative > target))
        before = cumulative[token - 1] if token else 0.0
        margin = min(cumulative[token] - target, target - before)
        out.append(Expected(token, settled and margin > EPSILON * total, loose))
    return out
