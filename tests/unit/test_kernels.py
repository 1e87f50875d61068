"""mlxd's CPU kernel (csrc/qmatmul.cpp) against MLX's own dequantize + matmul, and a real
quantized model run packed against the same model dequantized to float32."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxd import kernels
from mlxd.models.packed import PackedEmbedding, PackedLinear


def test_the_kernels_are_built_and_load() -> None:
    # `make` builds them (python -m mlxd.kernels.build); without them the CPU runs float32.
    assert kernels.available(), "mlxd's CPU kernels did not build: python -m mlxd.kernels.build"


def _reference(x: mx.array, weight: mx.array, scales, biases, group_size: int, bits: int):
    # In float32, as the kernel computes (float16 scales would round each weight to float16).
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return x.astype(mx.float32) @ w.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_qmatmul_equals_dequantize_then_matmul(bits: int, group_size: int, dtype) -> None:
    mx.random.seed(bits * 1000 + group_size)
    out_dims, in_dims = 96, 384
    weights = (mx.random.normal((out_dims, in_dims)) * 0.1).astype(dtype)
    weight, scales, biases = mx.quantize(weights, group_size=group_size, bits=bits)
    packed = kernels.pack(weight, scales, biases, group_size, bits)
    assert packed.shape == (out_dims, in_dims)
    # float16 scales (a float16 model's, a GGUF's) stay float16; float32 ones stay float32.
    assert packed.scale_bias.dtype == dtype
    # Every row count the kernel tiles differently: 1-8 in one pass, then passes of 8.
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33):
        x = mx.random.normal((rows, in_dims))
        expected = _reference(x, weight, scales, biases, group_size, bits)
        got = kernels.qmatmul(x, packed)
        assert got.shape == (rows, out_dims) and got.dtype == mx.float32
        assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item(), rows


def test_qmatmul_takes_batched_strided_and_half_inputs() -> None:
    weight, scales, biases = mx.quantize(mx.random.normal((64, 128)), group_size=32, bits=4)
    packed = kernels.pack(weight, scales, biases, 32, 4)
    x = mx.random.normal((2, 3, 128))
    assert mx.allclose(
        kernels.qmatmul(x, packed), _reference(x, weight, scales, biases, 32, 4), atol=1e-4
    ).item()
    strided = mx.random.normal((128, 5)).T  # not row-contiguous
    assert mx.allclose(
        kernels.qmatmul(strided, packed),
        _reference(strided, weight, scales, biases, 32, 4),
        atol=1e-4,
    ).item()
    half = x.astype(mx.float16)
    assert mx.allclose(
        kernels.qmatmul(half, packed), _reference(half, weight, scales, biases, 32, 4), atol=1e-3
    ).item()


def test_pack_refuses_what_the_kernel_cannot_run() -> None:
    weight, scales, biases = mx.quantize(mx.random.normal((48, 64)), group_size=32, bits=4)
    assert not kernels.packable(weight, 32, 4)  # 48 output rows: tiles are 32
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(weight, scales, biases, 32, 4)
    three_bit = mx.quantize(mx.random.normal((64, 64)), group_size=32, bits=3)[0]
    assert not kernels.packable(three_bit, 32, 3)


def test_the_packed_model_matches_its_float32_twin(smol, smol_packed) -> None:
    """SmolLM2's Q4_1 GGUF, packed (models/packed.py) and dequantized to float32: same
    weights, so the logits agree to float32 rounding and greedy decoding to the token."""
    layers = [m for _, m in smol_packed.model.named_modules()]
    assert any(isinstance(m, PackedLinear) for m in layers)
    assert any(isinstance(m, PackedEmbedding) for m in layers)
    assert not any(type(m) is nn.QuantizedLinear for m in layers)
    assert smol_packed.dtype == "q4/q8" and smol_packed.nbytes < smol.nbytes / 3
    tokenizer = smol.tokenizer
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = mx.array([tokenizer.encode(prompt)])
        packed_logits, float_logits = smol_packed.model(ids), smol.model(ids)
        assert mx.allclose(packed_logits, float_logits, atol=2e-3, rtol=1e-3).item()
        assert _greedy(smol_packed.model, ids) == _greedy(smol.model, ids)


def _greedy(model: nn.Module, ids: mx.array, tokens: int = 24) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache, out, x = make_prompt_cache(model), [], ids
    for _ in range(tokens):
        token = mx.argmax(model(x, cache=cache)[:, -1], axis=-1)
        out.append(token.item())
        x = token[None]
    return out
