"""The llama pipeline stage on a tiny random model, without a group: the layer split each rank
gets, and (in a one-rank group) the same tokens as the unsplit model through BatchGenerator."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama

from mlxd.distributed.pipeline import PipelinedLlama, pipeline_model
from mlxd.distributed.shard import split_model

ARGS = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 5,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 64,
    "tie_word_embeddings": True,
}


def tiny_llama(seed: int = 0) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(ARGS))
    mx.eval(model.parameters())
    return model


@dataclass
class StubGroup:
    """What the split reads of a group: its rank and size."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize(("rank", "first", "count"), [(0, 2, 3), (1, 0, 2)])
def test_each_rank_keeps_its_run_of_layers(rank: int, first: int, count: int):
    model = tiny_llama()
    kept = model.model.layers[first : first + count]
    stage = pipeline_model(model, StubGroup(rank, 2))  # type: ignore[arg-type]
    assert isinstance(stage, PipelinedLlama)
    # mlx-lm's split: the last rank runs the first layers; the low ranks get the extra one.
    assert [id(layer) for layer in stage.layers] == [id(layer) for layer in kept]
    assert len(stage.make_cache()) == count
    assert all(layer is None for layer in stage.model.layers[:first])


def test_one_rank_stage_generates_the_unsplit_tokens():
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3, 3, 3, 10]]  # left-padded together

    def generate(model) -> dict[int, list[int]]:
        generator = BatchGenerator(model, max_tokens=6, prefill_batch_size=4)
        uids = generator.insert(prompts)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        running = set(uids)
        while running:
            _, generated = generator.next()
            for response in generated:
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    running.discard(response.uid)
        return tokens

    expected = generate(tiny_llama())
    stage = pipeline_model(tiny_llama(), mx.distributed.init())
    assert isinstance(stage, PipelinedLlama)
    assert generate(stage) == expected


def test_split_model_refuses_a_split_that_does_not_fit():
    model = tiny_llama()
    config = {**ARGS}
    with pytest.raises(ValueError, match="needs attention heads divisible by 3"):
        split_model(model, config, "tensor", StubGroup(0, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one layer per rank"):
        split_model(model, config, "pipeline", StubGroup(0, 6))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy 'data'"):
        split_model(model, config, "data", StubGroup(0, 2))  # type: ignore[arg-type]
    assert split_model(model, config, "tensor", StubGroup(0, 1)) is model  # type: ignore[arg-type]
