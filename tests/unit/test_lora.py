"""Multi-LoRA (models/lora.py) on a tiny random llama in the real core: one batch mixing the
base and two adapters gives each row exactly the tokens of mlx-lm's own LoRA model."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_adapters

from mlxd.models.lora import MultiLoRA
from mlxd.worker.llm_core import LLMCore
from tests.tiny_llama import tiny_llama
from tests.unit.test_core import core_for, run, sequence, tokens_of

LORA = {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.up_proj"]}
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]


def tiny() -> llama.Model:
    return tiny_llama()  # the same base weights every time


def write_adapter(directory: Path, seed: int, num_layers: int) -> Path:
    """A random adapter in mlx-lm's format for the tiny llama's last `num_layers` layers."""
    model = tiny()
    linear_to_lora_layers(model, num_layers, LORA)
    key = mx.random.key(seed)
    weights = {}
    for name, array in tree_flatten(model.parameters()):
        if name.endswith((".lora_a", ".lora_b")):
            key, sub = mx.random.split(key)
            weights[name] = mx.random.uniform(-0.5, 0.5, array.shape, key=sub)
    directory.mkdir()
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": LORA}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def generate(core: LLMCore, prompts: list[list[int]], slots: list[int]) -> list[list[int]]:
    sequences = [sequence(p, max_tokens=8) for p in prompts]
    for seq, slot in zip(sequences, slots, strict=True):
        seq.slot = slot
        core.add(seq)
    outputs = run(core)
    return [tokens_of(outputs, seq) for seq in sequences]


def test_a_mixed_batch_gives_each_row_its_own_models_tokens(tmp_path: Path):
    # Adapters of different reach: one on both layers, one on the last only.
    adapters = [write_adapter(tmp_path / "a", 1, 2), write_adapter(tmp_path / "b", 2, 1)]
    model = tiny()
    core = core_for(model, max_batch_size=8, prefill_batch_size=8)
    core.lora = MultiLoRA(model, mx.float32)
    assert [core.lora.attach(a) for a in adapters] == [1, 2]
    mixed = generate(core, PROMPTS, [0, 1, 2])
    assert core.stats.max_batch_seen == 3

    base = generate(core_for(tiny()), PROMPTS[:1], [0])
    tuned = [
        generate(core_for(load_adapters(tiny(), str(a))), [p], [0])
        for a, p in zip(adapters, PROMPTS[1:], strict=True)
    ]
    assert mixed == base + tuned[0] + tuned[1]
    assert mixed[1] != generate(core_for(tiny()), PROMPTS[1:2], [0])[0]


def test_an_adapter_that_does_not_fit_changes_nothing(tmp_path: Path):
    good = write_adapter(tmp_path / "good", 1, 2)
    bad = write_adapter(tmp_path / "bad", 2, 2)
    weights = mx.load(str(bad / "adapters.safetensors"))
    weights["model.layers.1.mlp.up_proj.lora_b"] = mx.zeros((4, 7))
    mx.save_safetensors(str(bad / "adapters.safetensors"), weights)
    model = tiny()
    lora = MultiLoRA(model, mx.float32)
    with pytest.raises(ValueError, match=r"up_proj: adapter maps 32 -> 7 but the layer maps 32"):
        lora.attach(bad)
    assert not any(".linear." in name for name, _ in tree_flatten(model.parameters()))
    with pytest.raises(ValueError, match=r"has no adapters\.safetensors"):
        lora.attach(tmp_path)
    assert lora.attach(good) == 1  # a failed attach takes no slot
