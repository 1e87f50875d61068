"""A model of mixed widths (mlx-community's `mixed_*` recipes, a 6-bit layer over a 4-bit body,
an mxfp4 layer) runs what the kernels take packed (2-6 bits widened exactly to 4 or 8) and the
rest float32, says which and why, and is sized so before any weight is read (issue 26)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf

SIX_BIT = "model.layers.0.mlp.down_proj"
MXFP4 = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_widths_the_kernels_widen_multiply_exactly(bits: int):
    import mlx.core as mx

    from mlxd import kernels
    from mlxd.models.packed import pack

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    w = mx.random.normal((64, 256), key=mx.random.key(bits))
    quantized = mx.quantize(w, group_size=64, bits=bits)
    x = mx.random.normal((3, 256), key=mx.random.key(9))
    reference = x @ mx.dequantize(*quantized, group_size=64, bits=bits).T
    ours = kernels.qmatmul(x, pack(*quantized, 64, bits))
    assert mx.allclose(ours, reference, rtol=1e-4, atol=1e-4).item()


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama imported from a Q4_0 GGUF, then one layer requantized to 6 bits and one to
    mxfp4, with the per-module overrides mlx-lm writes into config.json."""
    import mlx.core as mx

    from mlxd.models.gguf import convert_gguf

    root = tmp_path_factory.mktemp("mixed")
    config = tiny_config("llama", hidden_size=128, intermediate_size=256)
    write_gguf(root / "m.gguf", config, tiny_weights(config), Q.Q4_0)
    out = root / "model"
    out.mkdir()
    convert_gguf(root / "m.gguf", out)
    weights = mx.load(str(out / "model.safetensors"))
    config_json = json.loads((out / "config.json").read_text())
    quant = config_json["quantization"]
    for name, override in (
        (SIX_BIT, {"group_size": 32, "bits": 6}),
        (MXFP4, {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
    ):
        stored = [weights.pop(f"{name}.{n}") for n in ("weight", "scales", "biases")]
        dense = mx.dequantize(*stored, quant["group_size"], quant["bits"])
        requantized = mx.quantize(dense, **override)
        names = (f"{name}.{n}" for n in ("weight", "scales", "biases"))
        weights.update(zip(names, requantized, strict=False))  # mxfp4 has no biases
        for key in ("quantization", "quantization_config"):
            if key in config_json:
                config_json[key][name] = override
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config_json))
    return out


def test_the_kernels_take_the_affine_layers_and_blas_the_mxfp4_one(mixed_dir: Path, caplog):
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd import kernels
    from mlxd.models.estimate import packed_weight_bytes
    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedLinear

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    with caplog.at_level(logging.INFO, logger="mlxd"):
        packed = load_llm(mixed_dir, dtype="auto", model_name="mixed")
    why = "mxfp4 quantization (the kernels take affine)"
    assert packed.float32_layers == {MXFP4: why}
    assert f"1 quantized layer runs float32 on BLAS, the kernels do not take them: {why}" in (
        caplog.text
    )
    layers = dict(packed.model.named_modules())
    assert type(layers[MXFP4]) is nn.Linear and layers[MXFP4].weight.dtype == mx.float32
    assert isinstance(layers[SIX_BIT], PackedLinear) and layers[SIX_BIT].bits == 8
    # (gate and up as one matmul: models/fused.py)
    assert isinstance(layers["model.layers.0.mlp.gate_up_proj"], PackedLinear)
    # Sized before loading, as it runs.
    assert packed_weight_bytes(mixed_dir) == pytest.approx(packed.nbytes, rel=0.02)
    # The same function as every layer dequantized to float32.
    reference = load_llm(mixed_dir, dtype="float32", model_name="mixed")
    tokens = mx.array([[1, 5, 9, 13, 2, 7]])
    ours, theirs = packed.model(tokens), reference.model(tokens)
    assert mx.allclose(ours, theirs, rtol=1e-3, atol=1e-3).item()


def test_quantized_experts_run_packed_and_are_said_to(tmp_path: Path, caplog):
    import mlx.core as mx

    from mlxd import kernels
    from mlxd.models.estimate import packed_weight_bytes
    from mlxd.models.gguf import convert_gguf
    from mlxd.models.loader import load_llm
    from mlxd.models.packed import PackedSwitchLinear

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    config = tiny_config("qwen3_moe", hidden_size=128, intermediate_size=256)
    write_gguf(tmp_path / "moe.gguf", config, tiny_weights(config), Q.Q4_0)
    (tmp_path / "model").mkdir()
    convert_gguf(tmp_path / "moe.gguf", tmp_path / "model")
    with caplog.at_level(logging.INFO, logger="mlxd"):
        loaded = load_llm(tmp_path / "model", dtype="auto", model_name="moe")
    layers = config["num_hidden_layers"]
    said = f"{3 * layers} quantized expert layers run packed on the kernels' gather matmul"
    assert loaded.experts == said and said in caplog.text
    experts = [m for _, m in loaded.model.named_modules() if isinstance(m, PackedSwitchLinear)]
    assert len(experts) == 3 * layers
    # Sized before loading, as it runs (the expert stacks packed).
    assert packed_weight_bytes(tmp_path / "model") == pytest.approx(loaded.nbytes, rel=0.02)
    # The same function as MLX's own quantized path (its gather_qmm), prompt and sorted path.
    reference = load_llm(tmp_path / "model", dtype="keep", model_name="moe")
    tokens = mx.array([[1, 5, 9, 13, 2, 7] * 12])
    ours, theirs = loaded.model(tokens), reference.model(tokens).astype(mx.float32)
    assert mx.allclose(ours, theirs, rtol=1e-2, atol=1e-2).item()
