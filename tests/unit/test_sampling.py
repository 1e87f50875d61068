"""Sampling parameters → mlx-lm logits processors and samplers; top-p and temperature draws
through mlxd's CPU kernel and through the MLX graph code a GPU runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_p

from mlxd.executor.logsumexp import exp_below, logsumexp
from mlxd.executor.nucleus import NucleusSampler, TemperatureSampler, draw, nucleus_of
from mlxd.executor.sampling import (
    GREEDY,
    make_sequence_processors,
    make_sequence_sampler,
    sample_rows,
)
from mlxd.types import SamplingParams
from tests import nucleus_reference


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


def _peaked_logprobs(rows: int, vocab: int, seed: int) -> mx.array:
    """Log-probabilities shaped like a trained model's: a heavy head over a long flat tail."""
    logits = mx.random.normal((rows, vocab), key=mx.random.key(seed)) * 5.0
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _support(logprobs: mx.array) -> list[set[int]]:
    kept = np.asarray(logprobs) > -np.inf
    return [set(np.flatnonzero(row).tolist()) for row in kept]


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95])
@pytest.mark.parametrize("vocab", [500, 49_152])
def test_the_sorted_nucleus_keeps_what_the_float64_rule_keeps(top_p, vocab):
    logprobs = _peaked_logprobs(4, vocab, seed=vocab)
    ids, values = nucleus_of(logprobs, mx.full((4, 1), top_p))
    kept = [
        {i for i, v in zip(row_ids, row_values, strict=True) if v > -np.inf}
        for row_ids, row_values in zip(ids.tolist(), values.tolist(), strict=True)
    ]
    exact = [
        set(np.flatnonzero(nucleus_reference.nucleus(row, top_p)).tolist())
        for row in np.asarray(logprobs)
    ]
    assert kept == exact
    full_sort = _support(apply_top_p(logprobs, top_p))
    # mlx-lm's float32 sums over the whole vocabulary can flip a token within rounding of the
    # threshold.
    assert all(len(ours ^ theirs) <= 1 for ours, theirs in zip(kept, full_sort, strict=True))


@pytest.mark.usefixtures("sampling_path")
def test_nucleus_keeps_ties_at_the_threshold():
    logprobs = mx.log(mx.array([[0.3, 0.2, 0.2, 0.2, 0.1]]))
    assert _support(apply_top_p(logprobs, 0.6))[0] == {0, 1, 2, 3}
    drawn = draw(mx.repeat(logprobs, 300, axis=0), [NucleusSampler(1.0, 0.6)] * 300)
    assert set(np.asarray(drawn).tolist()) == {0, 1, 2, 3}


@pytest.mark.usefixtures("sampling_path")
def test_nucleus_sampler_draws_exactly_the_nucleus():
    # Four tokens hold 0.9 of the mass; the rest of a 49k vocabulary shares the remainder.
    head = [0.4, 0.25, 0.15, 0.1]
    tail = (1 - sum(head)) / (49_152 - len(head))
    probs = mx.array([head + [tail] * (49_152 - len(head))])
    logprobs = mx.log(probs)
    support = _support(apply_top_p(logprobs, 0.9))[0]
    sampler = NucleusSampler(0.7, 0.9, key=mx.random.key(7))
    drawn = {int(sampler(logprobs)[0].item()) for _ in range(300)}
    assert drawn == support == {0, 1, 2, 3}


@pytest.mark.usefixtures("sampling_path")
def test_seeded_nucleus_sampling_repeats():
    logprobs = _peaked_logprobs(3, 49_152, seed=1)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=42)
    first = make_sequence_sampler(params, 49_152)
    second = make_sequence_sampler(params, 49_152)
    assert isinstance(first, NucleusSampler)
    runs = [
        [first(logprobs).tolist() for _ in range(5)],
        [second(logprobs).tolist() for _ in range(5)],
    ]
    assert runs[0] == runs[1]


def test_top_p_with_min_p_keeps_mlx_lms_chain():
    params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05)
    assert not isinstance(make_sequence_sampler(params, 49_152), NucleusSampler)


def _head_and_tail(head: list[float], vocab: int) -> list[float]:
    """Log-probabilities of `head` followed by an even share of the rest over the vocabulary."""
    tail = (1 - sum(head)) / (vocab - len(head))
    return np.log(head + [tail] * (vocab - len(head))).tolist()


def _mlx_lm_distribution(logprobs: mx.array, temperature: float, top_p: float) -> np.ndarray:
    """What mlx-lm's make_sampler(temperature, top_p) draws from, per token."""
    return np.asarray(mx.softmax(apply_top_p(logprobs, top_p) / temperature, axis=-1))


@pytest.mark.usefixtures("sampling_path")
def test_top_p_rows_draw_mlx_lms_distribution_seeded_or_not():
    # A peaked row (a nucleus of 3 tokens) and a wide one (40 tokens of 0.023, as a random
    # model's), drawn in one batched call; half the rows seeded, half from the global state.
    vocab, copies, temperature = 512, 1500, 0.7
    peaked = _head_and_tail([0.5, 0.3, 0.15], vocab)
    wide = _head_and_tail([0.023] * 40, vocab)
    logprobs = mx.array([peaked, wide] * copies)
    samplers = [
        NucleusSampler(temperature, 0.9, mx.random.key(row) if row % 4 < 2 else None)
        for row in range(2 * copies)
    ]
    mx.random.seed(3)
    drawn = np.asarray(draw(logprobs, samplers)).reshape(copies, 2)
    for column, row in enumerate((peaked, wide)):
        expected = _mlx_lm_distribution(mx.array([row]), temperature, 0.9)[0]
        counts = np.bincount(drawn[:, column], minlength=vocab)
        support = expected > 0
        assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(support))
        # Chi-square against mlx-lm's distribution, generous: its mean is the degrees of
        # freedom (2 and 39), its standard deviation √(2·df).
        chi2 = (((counts - copies * expected) ** 2)[support] / (copies * expected[support])).sum()
        df = support.sum() - 1
        assert chi2 < df + 6 * np.sqrt(2 * df)


@pytest.mark.usefixtures("sampling_path")
def test_seeded_rows_draw_the_same_tokens_whatever_shares_their_batch():
    vocab = 4096
    peaked = _peaked_logprobs(1, vocab, seed=5)
    flat = mx.random.normal((1, vocab), key=mx.random.key(6)) * 0.1  # a random model's

    def seeded(seed: int, top_p: float = 0.9) -> NucleusSampler:
        sampler = make_sequence_sampler(
            SamplingParams(temperature=0.7, top_p=top_p, seed=seed), vocab
        )
        assert isinstance(sampler, NucleusSampler)  # TemperatureSampler at top_p 1
        return sampler

    def tokens(logits: mx.array, samplers: list, rows: list[int]) -> list[list[int]]:
        out = []
        for _ in range(4):
            out.append(np.asarray(sample_rows(logits, samplers).tokens)[rows].tolist())
        return out

    alone = tokens(
        mx.concatenate([peaked, flat, peaked]), [seeded(1), seeded(2), seeded(3, 1.0)], [0, 1, 2]
    )
    unseeded = make_sequence_sampler(SamplingParams(temperature=0.7, top_p=0.9), vocab)
    chain = make_sequence_sampler(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05), vocab)
    mixed = mx.concatenate([flat, peaked, peaked, flat, peaked, flat, peaked, flat])
    samplers = [
        unseeded,
        seeded(1),
        GREEDY,
        seeded(2),
        chain,
        make_sequence_sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=9), vocab),
        seeded(3, 1.0),
        make_sequence_sampler(SamplingParams(temperature=0.9), vocab),
    ]
    assert tokens(mixed, samplers, [1, 3, 6]) == alone


def test_logsumexp_from_multiply_adds_keeps_float32_precision():
    rows = [
        mx.random.normal((128_256,), key=mx.random.key(i)) * s for i, s in enumerate((0.1, 5, 30))
    ]
    masked = mx.full((128_256,), -mx.inf)
    masked[:3] = mx.array([1.0, -80.0, -200.0])  # a constrained row: most tokens excluded
    logits = mx.stack([*rows, masked])
    wide = np.asarray(logits).astype(np.float64)
    top = wide.max(axis=-1, keepdims=True)
    expected = top[:, 0] + np.log(np.exp(wide - top).sum(axis=-1))
    # The float32 sum over 128k terms rounds at ≈1e-5 (mx.logsumexp's too); each term's exp
    # is within 3e-7 of the exact one.
    assert np.allclose(np.asarray(logsumexp(logits))[:, 0], expected, rtol=1e-5, atol=1e-6)
    top32 = np.asarray(logits).max(axis=-1, keepdims=True)
    ours = np.asarray(exp_below(logits, mx.array(top32)))
    exact = np.exp((np.asarray(logits) - top32).astype(np.float64))  # the same float32 shift
    normal = exact > 1e-37
    assert np.allclose(ours[normal], exact[normal], rtol=3e-7, atol=0)
    assert (ours[exact < np.exp(-87.0)] == 0).all()  # below float32's normal range: none


@pytest.mark.usefixtures("sampling_path")
def test_temperature_alone_draws_the_tempered_softmax_seeded_or_not():
    vocab, copies, temperature = 64, 3000, 0.7
    logits = mx.random.normal((1, vocab), key=mx.random.key(8)) * 2
    logits[0, 5] = -mx.inf  # a masked token is never drawn
    samplers = [
        make_sequence_sampler(
            SamplingParams(temperature=temperature, seed=row if row % 2 else None), vocab
        )
        for row in range(copies)
    ]
    assert all(isinstance(s, TemperatureSampler) for s in samplers)
    mx.random.seed(4)
    tokens = sample_rows(mx.repeat(logits, copies, axis=0), samplers).tokens
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    expected = np.asarray(mx.softmax(logits / temperature, axis=-1))[0]
    assert counts[5] == 0
    support = expected > 0
    chi2 = (((counts - copies * expected) ** 2)[support] / (copies * expected[support])).sum()
    df = support.sum() - 1
    assert chi2 < df + 6 * np.sqrt(2 * df)
    again = make_sequence_sampler(SamplingParams(temperature=temperature, seed=1), vocab)
    alone = make_sequence_sampler(SamplingParams(temperature=temperature, seed=1), vocab)
    assert [again(logits).item() for _ in range(5)] == [alone(logits).item() for _ in range(5)]
