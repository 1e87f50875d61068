"""Embedding pieces that need no model: batch planning, pooling, sentence-transformers
config reading and request validation."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from pydantic import ValidationError

from mlxd.api.openai.protocol import EmbeddingRequest
from mlxd.config import BatchConfig
from mlxd.errors import Unavailable
from mlxd.models.activations import RationalGELU, gelu_rational, use_rational_gelu
from mlxd.models.embedding import Pooling, pool, read_max_length, read_pooling
from mlxd.worker.embedding_core import EmbeddingCore, EmbeddingJob, plan_batches
from mlxd.worker.jobs import deliver
from mlxd.worker.loop import ModelLoop


def test_batches_are_sorted_by_length_and_capped_by_count():
    lengths = [9, 3, 7, 3, 5]
    batches = plan_batches(lengths, max_batch_size=2, token_budget=1000)
    assert batches == [[1, 3], [4, 2], [0]]


def test_batches_respect_the_padded_token_budget():
    # 4 inputs of 10 tokens fit a 40-token budget; a fifth would make 50.
    assert plan_batches([10] * 5, max_batch_size=64, token_budget=40) == [[0, 1, 2, 3], [4]]
    # Padding counts: two of 3 and one of 30 would be 3 × 30 = 90 padded tokens.
    assert plan_batches([3, 30, 3], max_batch_size=64, token_budget=60) == [[0, 2], [1]]


def test_an_input_longer_than_the_budget_goes_alone():
    assert plan_batches([500, 2, 2], max_batch_size=8, token_budget=100) == [[1, 2], [0]]


def test_every_input_is_planned_exactly_once():
    lengths = list(np.random.default_rng(0).integers(1, 300, size=200))
    batches = plan_batches(lengths, max_batch_size=16, token_budget=2048)
    assert sorted(i for batch in batches for i in batch) == list(range(200))
    for batch in batches:
        assert len(batch) <= 16
        assert len(batch) == 1 or len(batch) * max(lengths[i] for i in batch) <= 2048


HIDDEN = mx.array([[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]], [[0.0, 2.0], [0.0, 0.0], [0.0, 0.0]]])
MASK = mx.array([[1, 1, 0], [1, 0, 0]])  # the 100s are padding


@pytest.mark.parametrize(
    ("modes", "expected"),
    [
        (("mean_tokens",), [[2.0, 2.0], [0.0, 2.0]]),
        (("cls_token",), [[1.0, 0.0], [0.0, 2.0]]),
        (("max_tokens",), [[3.0, 4.0], [0.0, 2.0]]),
        (("lasttoken",), [[3.0, 4.0], [0.0, 2.0]]),
        (("mean_sqrt_len_tokens",), [[4 / 2**0.5, 4 / 2**0.5], [0.0, 2.0]]),
        (("cls_token", "mean_tokens"), [[1.0, 0.0, 2.0, 2.0], [0.0, 2.0, 0.0, 2.0]]),
    ],
)
def test_pooling_ignores_padding(modes, expected):
    vectors = pool(HIDDEN, MASK, Pooling(modes, normalize=False))
    np.testing.assert_allclose(np.array(vectors), expected, rtol=1e-6)


def test_normalize_gives_unit_vectors():
    vectors = np.array(pool(HIDDEN, MASK, Pooling(("mean_tokens",), normalize=True)))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-6)


def _st_model(tmp_path: Path, modules: list[dict], pooling: dict | None = None) -> Path:
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


ST = "sentence_transformers.models."
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": f"{ST}Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{ST}Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{ST}Normalize"}


def test_pooling_defaults_to_mean_and_normalize_without_sentence_transformers_files(tmp_path):
    assert read_pooling(tmp_path) == Pooling(("mean_tokens",), normalize=True)


def test_pooling_follows_the_model_config(tmp_path):
    model = _st_model(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode_cls_token": True})
    assert read_pooling(model) == Pooling(("cls_token",), normalize=False)


def test_normalize_module_turns_normalisation_on(tmp_path):
    model = _st_model(
        tmp_path, [TRANSFORMER, POOLING, NORMALIZE], {"pooling_mode_mean_tokens": True}
    )
    assert read_pooling(model) == Pooling(("mean_tokens",), normalize=True)


def test_unsupported_modules_are_refused(tmp_path):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": f"{ST}Dense"}
    model = _st_model(tmp_path, [TRANSFORMER, POOLING, dense], {"pooling_mode_mean_tokens": True})
    with pytest.raises(ValueError, match="Dense"):
        read_pooling(model)


def test_max_length_prefers_sentence_transformers_then_the_smallest_limit(tmp_path):
    config = {"max_position_embeddings": 514}
    assert read_max_length(tmp_path, config, 10**30) == 514
    assert read_max_length(tmp_path, config, 512) == 512
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert read_max_length(tmp_path, config, 512) == 128


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("one", ["one"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_input_forms_become_a_list_of_inputs(value, inputs):
    assert EmbeddingRequest(model="m", input=value).inputs() == inputs


@pytest.mark.parametrize("value", ["", [], [""], ["a", ""], [[1], []], [1.5], [{"x": 1}]])
def test_empty_or_malformed_input_is_rejected(value):
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", input=value)


def test_encoding_format_and_dimensions_are_checked():
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", input="x", encoding_format="hex")
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", input="x", dimensions=0)
    assert EmbeddingRequest(model="m", input="x", dimensions=8).dimensions == 8


def test_rational_gelu_matches_the_exact_gelu():
    x = mx.linspace(-12, 12, 100_001)
    assert mx.abs(gelu_rational(x) - nn.gelu(x)).max().item() < 2e-6


def test_only_exact_gelu_modules_are_swapped():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.GELU(approx="tanh"))
    assert use_rational_gelu(model) == 1
    assert [type(layer) for layer in model.layers] == [nn.Linear, RationalGELU, nn.GELU]


def embedding_loop(forward, config: BatchConfig, arriving) -> ModelLoop:
    """The engine's model thread around a stand-in encoder."""
    return ModelLoop("t", EmbeddingCore("t", forward, config, arriving), deliver, max_queue=8)


def _first_token(batch: list[list[int]]) -> np.ndarray:
    """A stand-in encoder whose vector is the input's first token and length."""
    return np.array([[ids[0], len(ids)] for ids in batch], dtype=np.float32)


def test_model_loop_splits_a_request_across_passes_and_keeps_its_order():
    passes: list[int] = []

    def forward(batch: list[list[int]]) -> np.ndarray:
        passes.append(len(batch))
        return _first_token(batch)

    config = BatchConfig(max_batch_size=4, prefill_step_size=1000)
    model_loop = embedding_loop(forward, config, arriving=lambda: 0)
    inputs = [[i] * (10 - i) for i in range(10)]  # longest first: sorting reorders them

    async def submit() -> np.ndarray:
        loop = asyncio.get_running_loop()
        job = EmbeddingJob(inputs, loop, loop.create_future())
        model_loop.submit(job)
        return await job.future

    try:
        vectors = asyncio.run(submit())
    finally:
        model_loop.close()
    assert vectors.tolist() == [[i, 10 - i] for i in range(10)]
    assert passes == [4, 4, 2]
    assert model_loop.core.stats.forward_passes == 3 and model_loop.core.stats.inputs == 10
    assert model_loop.core.waiting == 0


def test_model_loop_close_fails_what_is_still_open():
    release = threading.Event()

    def forward(batch: list[list[int]]) -> np.ndarray:
        release.wait(5)
        return _first_token(batch)

    model_loop = embedding_loop(forward, BatchConfig(max_batch_size=1), arriving=lambda: 0)

    async def submit_then_close() -> None:
        loop = asyncio.get_running_loop()
        job = EmbeddingJob([[1], [2], [3]], loop, loop.create_future())
        model_loop.submit(job)
        closing = asyncio.create_task(asyncio.to_thread(model_loop.close))
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(Unavailable, match="unloaded"):  # a 503: the model went away
            await job.future
        await closing

    asyncio.run(submit_then_close())
    assert model_loop.core.stats.failed == 1 and model_loop.core.waiting == 0


def test_a_short_request_is_not_held_back_by_a_long_one():
    passes: list[list[int]] = []

    def forward(batch: list[list[int]]) -> np.ndarray:
        passes.append([ids[0] for ids in batch])
        return _first_token(batch)

    config = BatchConfig(max_batch_size=4, prefill_step_size=1000)
    # "Always one on its way": the thread waits its window, so both jobs start together.
    model_loop = embedding_loop(forward, config, arriving=lambda: 1)

    async def submit_both() -> None:
        loop = asyncio.get_running_loop()
        long = EmbeddingJob([[1]] * 100, loop, loop.create_future())
        short = EmbeddingJob([[2]], loop, loop.create_future())
        model_loop.submit(long)
        model_loop.submit(short)
        await asyncio.gather(long.future, short.future)

    try:
        asyncio.run(submit_both())
    finally:
        model_loop.close()
    # The short request's input is in the first round (4 passes of 4), not after 25 passes.
    assert 2 in [token for batch in passes[:4] for token in batch]
    assert sum(map(len, passes)) == 101
