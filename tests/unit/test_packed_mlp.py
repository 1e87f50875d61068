"""A SwiGLU MLP on packed weights as one kernel call (csrc/mlp.cpp): the same numbers, to the
bit, as its ops run one by one (norm, gate and up, SwiGLU, down, residual), on every ISA variant
this CPU runs, at one decode row, a register pass of several and a buffered prefill pass."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxd import kernels
from mlxd.kernels import Packed
from mlxd.models.fused import fuse
from mlxd.models.packed import PackedLinear, pack

# (dot, precise): pack's float layout, pack_dot's with x as two int8 terms, and as one.
LAYOUTS = [(False, True), (True, True), (True, False)]


def _linear(
    rows: int, inputs: int, bits: int, group: int, dot: bool, precise: bool
) -> PackedLinear:
    weight = mx.random.normal((rows, inputs)) * 0.05
    return PackedLinear(
        pack(
            *mx.quantize(weight, group_size=group, bits=bits), group, bits, dot=dot, precise=precise
        ),
        None,
    )


def _apart(x: mx.array, gate: Packed, up: Packed, down: Packed, norm, residual: bool) -> mx.array:
    h = kernels.rms_norm(x, *norm) if norm is not None else x
    y = kernels.qmatmul(kernels.swiglu(kernels.qmatmul(h, gate), kernels.qmatmul(h, up)), down)
    return x + y if residual else y


@pytest.mark.parametrize(("dot", "precise"), LAYOUTS)
@pytest.mark.parametrize(("down_bits", "group"), [(4, 32), (8, 64)])
def test_one_call_computes_the_ops_apart_on_each_isa(
    kernel_isa: str, dot: bool, precise: bool, down_bits: int, group: int
) -> None:
    mx.random.seed(3)
    hidden, inner = 576, 1536  # SmolLM2's MLP
    gate, up = (_linear(inner, hidden, 4, group, dot, precise) for _ in range(2))
    down = _linear(hidden, inner, down_bits, group, dot, precise)
    gate_up = fuse([gate, up])
    assert gate_up is not None
    norm = (mx.random.uniform(0.5, 1.5, (hidden,)), 1e-5)
    for rows in (1, 5, 40):  # one decode row, a register pass, a buffered pass
        x = mx.random.normal((rows, 1, hidden))
        for with_norm, residual in ((False, False), (True, True), (True, False)):
            used = norm if with_norm else None
            one = kernels.packed_mlp(x, gate_up.packed, down.packed, used, residual)
            apart = _apart(x, gate.packed, up.packed, down.packed, used, residual)
            assert one.shape == x.shape and one.dtype == mx.float32
            assert mx.array_equal(one, apart).item(), (kernel_isa, rows, with_norm, residual)


def test_one_call_at_a_billion_weights_shape(kernel_isa: str) -> None:
    """Llama-3.2-1B's MLP (2,048 → 8,192 → 2,048), K-quant-like float32 scales on the down
    projection: the widths and scale types of the two matrices are their own."""
    mx.random.seed(5)
    gate, up = (_linear(8192, 2048, 4, 32, True, False) for _ in range(2))
    weight = mx.random.normal((2048, 8192)) * 0.05
    q, scales, biases = mx.quantize(weight, group_size=32, bits=8)
    # Scales float16 cannot hold: the packing keeps them float32.
    down = kernels.pack_dot(q, scales * (1 + 2**-20), biases, 32, 8, precise=False)
    assert down.scale_bias.dtype == mx.float32
    gate_up = fuse([gate, up])
    assert gate_up is not None and gate_up.packed.scale_bias.dtype == mx.float16
    for rows in (1, 40):
        x = mx.random.normal((rows, 2048))
        one = kernels.packed_mlp(x, gate_up.packed, down, None, True)
        assert mx.array_equal(one, _apart(x, gate.packed, up.packed, down, None, True)).item()


def test_disagreeing_shapes_are_refused() -> None:
    mx.random.seed(3)
    gate_up = fuse([_linear(256, 128, 4, 32, False, True) for _ in range(2)])
    down = _linear(128, 256, 4, 32, False, True)
    assert gate_up is not None
    with pytest.raises(ValueError, match="do not agree"):  # x is not down's output width
        kernels.packed_mlp(mx.zeros((1, 64)), gate_up.packed, down.packed)
    with pytest.raises(ValueError, match="do not agree"):  # down's inputs are not I
        kernels.packed_mlp(
            mx.zeros((1, 128)), gate_up.packed, _linear(128, 128, 4, 32, False, True).packed
        )
    with pytest.raises(ValueError, match="norm weight"):
        kernels.packed_mlp(mx.zeros((1, 128)), gate_up.packed, down.packed, (mx.ones((64,)), 1e-5))
    with pytest.raises(ValueError, match="float32 x"):
        kernels.packed_mlp(mx.zeros((1, 128), dtype=mx.float16), gate_up.packed, down.packed)
