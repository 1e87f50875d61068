"""Packed q, k and v projections run as one kernel call, gate and up as another
(models/fused.py): the same numbers as apart, and given back apart for a LoRA adapter."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd import kernels
from mlxd.models.fused import Fused, fuse
from mlxd.models.kernel_layers import KernelAttention, split_fused_projections
from mlxd.models.packed import PackedLinear, SplitLinear, pack

pytestmark = pytest.mark.skipif(not kernels.available(), reason="mlxd's CPU kernels not built")


def linear(rows: int, inputs: int, dot: bool, bias: bool, group: int = 32) -> PackedLinear:
    w = mx.random.normal((rows, inputs)) * 0.05
    quantized = mx.quantize(w, group_size=group, bits=4)
    return PackedLinear(
        pack(*quantized, group, 4, dot=dot), mx.random.normal((rows,)) if bias else None
    )


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_one_call_gives_each_projection_exactly(dot: bool, bias: bool) -> None:
    mx.random.seed(7)
    parts = [linear(rows, 256, dot, bias) for rows in (256, 64, 64)]
    fused = fuse(parts)
    assert isinstance(fused, Fused)
    assert fused.parts == [slice(0, 256), slice(256, 320), slice(320, 384)]
    for rows in (1, 8, 40):  # registers, and the buffered pass
        x = mx.random.normal((rows, 256))
        for part, output in zip(parts, fused.outputs(x), strict=True):
            assert mx.array_equal(part(x), output).item()
    for part, again in zip(parts, fused.split(), strict=True):
        assert mx.array_equal(part.weight, again.weight).item()
        assert mx.array_equal(part.scale_bias, again.scale_bias).item()
        assert ("bias" in again) == bias and (not bias or mx.array_equal(part.bias, again.bias))


def test_layers_of_another_kind_or_layout_stay_apart() -> None:
    mx.random.seed(7)
    parts = [linear(64, 256, False, False) for _ in range(3)]
    assert fuse([*parts[:2], linear(64, 256, True, False)]) is None  # another layout
    assert fuse([*parts[:2], linear(64, 256, False, True)]) is None  # one bias of three
    assert fuse([*parts[:2], linear(64, 128, False, False)]) is None  # another input width
    assert fuse([*parts[:2], linear(64, 256, False, False, 64)]) is None  # scales per 64
    split = SplitLinear(parts[2], mx.zeros((64, 256)), lambda rows: "packed")
    assert fuse([*parts[:2], split]) is None  # the mixed plan's two weight sets


def test_a_load_packs_each_group_as_one_matrix_which_fuses_without_a_copy() -> None:
    """`pack_model` packs a group's layers as views of one matrix, each computing what its
    stored layer did; `fuse` then takes that matrix as it is. A layer of no group, and a
    group's layers taken from the packed file already so, stay as they are."""
    import mlx.nn as nn

    from mlxd.models.packed import pack_model

    mx.random.seed(7)

    def quantized(outputs: int, inputs: int) -> nn.QuantizedLinear:
        return nn.QuantizedLinear.from_linear(nn.Linear(inputs, outputs), group_size=32, bits=4)

    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate_proj, model.mlp.up_proj = quantized(96, 256), quantized(96, 256)
    model.mlp.down_proj = quantized(256, 96)
    x = mx.random.normal((3, 256))
    stored = [model.mlp.gate_proj(x), model.mlp.up_proj(x)]
    layers, packed_here = pack_model(model, dot=True)
    assert packed_here == 3
    gate, up = model.mlp.gate_proj, model.mlp.up_proj
    assert gate.whole is not None and up.whole is gate.whole
    assert (gate.first_row, up.first_row) == (0, 96)
    assert layers["mlp.up_proj"].whole is gate.whole and layers["mlp.down_proj"].whole is None
    for layer, y in zip((gate, up), stored, strict=True):
        assert mx.allclose(layer(x), y, atol=1e-2, rtol=1e-2).item()
    fused = fuse([gate, up], copy=False)
    assert fused is not None and fused.weight is gate.whole.weight  # no copy
    # Separate arrays do not fuse without a copy.
    assert fuse([linear(96, 256, True, False), linear(96, 256, True, False)], copy=False) is None


def test_a_packed_model_computes_the_same_with_its_projections_fused(smol, tmp_path) -> None:
    from mlxd.models.activations import RationalSwiGLU
    from mlxd.models.loader import load_llm
    from mlxd.models.packed_cache import wait_for_writes

    # As the CPU engine loads it: the first load packs each group as one matrix's rows (no
    # copy when it fuses them), the next maps them from the packed file, which keeps them so.
    first = load_llm(smol.path, dtype="auto", model_name="smol", cache_dir=tmp_path)
    wait_for_writes()
    assert all(
        "gate_up_proj" in mlp
        for _, mlp in first.model.named_modules()
        if isinstance(mlp, RationalSwiGLU)
    )
    loaded = load_llm(smol.path, dtype="auto", model_name="smol", cache_dir=tmp_path)
    attentions = [m for _, m in loaded.model.named_modules() if isinstance(m, KernelAttention)]
    assert attentions and all("qkv_proj" in a and "q_proj" not in a for a in attentions)
    mlps = [m for _, m in loaded.model.named_modules() if isinstance(m, RationalSwiGLU)]
    assert mlps and all("gate_up_proj" in m and "gate_proj" not in m for m in mlps)
    ids = mx.array([smol.tokenizer.encode("The capital of France is")])
    fused = loaded.model(ids)
    split_fused_projections(loaded.model)
    assert all("qkv_proj" not in a and "q_proj" in a for a in attentions)
    assert all("gate_up_proj" not in m and "gate_proj" in m for m in mlps)
    assert mx.array_equal(loaded.model(ids), fused).item()
