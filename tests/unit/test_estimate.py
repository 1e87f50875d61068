"""Memory estimates from safetensors headers, on tiny synthetic model dirs (nothing is loaded)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mlxd.errors import ModelLoadError
from mlxd.models import loader
from mlxd.models.estimate import estimate_model_bytes, estimate_weight_bytes


def make_model(
    tmp_path: Path, shards: dict[str, dict[str, np.ndarray]], quantization: dict | None = None
) -> Path:
    config: dict = {"model_type": "llama"}
    if quantization is not None:
        config["quantization"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    for filename, tensors in shards.items():
        save_file(tensors, str(tmp_path / filename))
    return tmp_path


def quantized(prefix: str, out: int, packed: int, groups: int) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight": np.zeros((out, packed), np.uint32),
        f"{prefix}.scales": np.zeros((out, groups), np.float16),
        f"{prefix}.biases": np.zeros((out, groups), np.float16),
    }


FP16 = {
    "model.embed_tokens.weight": np.zeros((16, 8), np.float16),
    "model.norm.weight": np.zeros((8,), np.float16),
}
FP16_BYTES = (16 * 8 + 8) * 2


def test_float16_cast_to_float32_doubles_and_keep_is_stored(tmp_path):
    model = make_model(tmp_path, {"model.safetensors": FP16})
    assert estimate_weight_bytes(model, "float32") == 2 * FP16_BYTES
    assert estimate_weight_bytes(model, "bfloat16") == FP16_BYTES
    assert estimate_weight_bytes(model, "keep") == FP16_BYTES


def test_auto_follows_the_loader_backend_choice(tmp_path, monkeypatch):
    model = make_model(tmp_path, {"model.safetensors": FP16})
    monkeypatch.setattr(loader, "backend_name", lambda: "cpu")
    assert estimate_weight_bytes(model, "auto") == 2 * FP16_BYTES
    monkeypatch.setattr(loader, "backend_name", lambda: "metal")
    assert estimate_weight_bytes(model, "auto") == FP16_BYTES


def test_keep_counts_every_stored_tensor(tmp_path):
    tensors = {**quantized("model.layers.0.mlp", 8, 4, 1), "ids": np.zeros((3,), np.int64)}
    model = make_model(tmp_path, {"model.safetensors": tensors}, {"group_size": 32, "bits": 4})
    assert estimate_weight_bytes(model, "keep") == sum(a.nbytes for a in tensors.values())


def test_quantized_layer_dequantizes_to_out_by_in(tmp_path):
    tensors = {
        **quantized("model.layers.0.mlp", 8, 4, 1),
        "model.norm.weight": FP16["model.norm.weight"],
    }
    model = make_model(tmp_path, {"model.safetensors": tensors}, {"group_size": 32, "bits": 4})
    # 4 uint32 × 8 nibbles = 32 inputs = 1 group of 32.
    assert estimate_weight_bytes(model, "float32") == 8 * 32 * 4 + 8 * 4
    assert estimate_weight_bytes(model, "float16") == 8 * 32 * 2 + 8 * 2


def test_per_module_override_of_group_size_and_bits(tmp_path):
    tensors = {
        **quantized("model.layers.0.mlp", 8, 4, 1),  # global: 4 bits, group 32 → 32 inputs
        **quantized("model.embed_tokens", 16, 16, 1),  # override: 8 bits, group 64 → 64 inputs
    }
    quantization = {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 64, "bits": 8},
    }
    model = make_model(tmp_path, {"model.safetensors": tensors}, quantization)
    assert estimate_weight_bytes(model, "float32") == (8 * 32 + 16 * 64) * 4


def test_group_size_defaults_to_64(tmp_path):
    tensors = quantized("model.layers.0.mlp", 8, 8, 1)
    model = make_model(tmp_path, {"model.safetensors": tensors}, {"bits": 4})
    assert estimate_weight_bytes(model, "float32") == 8 * 64 * 4


def test_non_float_tensors_keep_their_size_in_a_cast(tmp_path):
    tensors = {"model.norm.weight": np.zeros((8,), np.float16), "ids": np.zeros((3,), np.int64)}
    model = make_model(tmp_path, {"model.safetensors": tensors})
    assert estimate_weight_bytes(model, "float32") == 8 * 4 + 3 * 8


def test_shards_are_summed_and_other_files_ignored(tmp_path):
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": np.zeros((4, 4), np.float16)},
        "model-00002-of-00002.safetensors": {"b.weight": np.zeros((2, 4), np.float16)},
        # mlx-lm reads only model*.safetensors: adapters and the like are not model weights.
        "adapters.safetensors": {"c.weight": np.zeros((64, 64), np.float16)},
    }
    model = make_model(tmp_path, shards)
    assert estimate_weight_bytes(model, "float32") == (16 + 8) * 4
    assert estimate_weight_bytes(model, "keep") == (16 + 8) * 2


def test_model_bytes_adds_the_kv_budget(tmp_path):
    model = make_model(tmp_path, {"model.safetensors": FP16})
    assert estimate_model_bytes(model, "keep", 1000) == FP16_BYTES + 1000


def test_missing_dir_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=re.escape(str(missing))):
        estimate_weight_bytes(missing, "keep")


def test_dir_without_weights_names_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=f"safetensors.*{re.escape(str(tmp_path))}"):
        estimate_weight_bytes(tmp_path, "keep")


def test_unknown_dtype(tmp_path):
    model = make_model(tmp_path, {"model.safetensors": FP16})
    with pytest.raises(ModelLoadError, match="int8"):
        estimate_weight_bytes(model, "int8")


@pytest.mark.parametrize(
    "content",
    [
        b"\x01",  # shorter than the length prefix
        struct.pack("<Q", 2**40) + b"{}",  # implausible header length
        struct.pack("<Q", 100) + b"{}",  # file shorter than the header
        struct.pack("<Q", 5) + b"{nope",  # not JSON
        struct.pack("<Q", 2) + b"[]",  # not an object
        struct.pack("<Q", 17) + b'{"a": {"x": 1}} ',  # entry without dtype/shape/offsets
    ],
)
def test_corrupt_header(tmp_path, content):
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "model.safetensors"))):
        estimate_weight_bytes(tmp_path, "keep")


def test_real_smollm2_matches_loaded_sizes(smol):
    # Sizes load_llm measured: float32 dequantized, and the stored q4/q8 weights.
    assert estimate_weight_bytes(smol.path, "float32") == pytest.approx(538_060_032, rel=0.01)
    assert estimate_weight_bytes(smol.path, "keep") == pytest.approx(98_346_240, rel=0.01)
