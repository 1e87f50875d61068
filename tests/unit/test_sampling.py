"""Sampling parameters → mlx-lm logits processors."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd.executor.sampling import make_sequence_processors
from mlxd.types import SamplingParams


def penalised(params: SamplingParams, history: list[int]) -> list[int]:
    """Token ids whose logit the processors changed, given the tokens generated so far."""
    logits = mx.ones((1, 16))
    for processor in make_sequence_processors(params, max_tokens=64):
        logits = processor(mx.array(history), logits)
    return [i for i, value in enumerate(logits[0].tolist()) if value != 1.0]


@pytest.mark.parametrize(("context", "expected"), [(1, [7]), (2, [3, 7]), (None, [3, 5, 7])])
def test_repetition_context_size_bounds_the_penalised_history(context, expected):
    params = SamplingParams(repetition_penalty=2.0, repetition_context_size=context)
    assert penalised(params, [5, 3, 7]) == expected
