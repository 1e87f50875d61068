"""mlxd's CPU kernels on every ISA variant this machine runs (csrc/simd.h, csrc/dispatch.cpp):
the packed matmul against MLX's dequantize + matmul at real model shapes, on two threads, and
the dispatch itself (the best variant by default, MLXD_KERNELS_ISA forcing one)."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxd import kernels

# (N outputs, K inputs, group size, bits, scale dtype): every K of the models mlxd serves
# (SmolLM2 576, Llama-3.2-1B 2048, 8B 4096 and its MLP's 14,336, 8,192), every group size
# and width; float16 scales as a GGUF's, float32 as an MLX-quantized float32 model's. 160
# outputs: an odd number of work items for two threads (5 pairs of 16-row tiles).
SHAPES = [
    (160, 576, 32, 4, mx.float16),
    (160, 576, 64, 8, mx.float32),
    (160, 2048, 64, 4, mx.float32),
    (160, 2048, 128, 8, mx.float16),
    (160, 4096, 128, 4, mx.float16),
    (160, 4096, 32, 8, mx.float32),
    (160, 8192, 32, 4, mx.float16),
    (96, 14336, 64, 4, mx.float16),
    (96, 14336, 128, 8, mx.float32),
]
# Every way the kernel splits rows: one pass of 1-8 (AVX-512) or 1-6 (AVX2) rows, several
# passes with a remainder, and from 32 rows on the buffered (prefill) path with its tails.
ROWS = (1, 2, 3, 5, 6, 7, 8, 9, 13, 31, 32, 33, 64, 70)


def _case(n: int, k: int, group_size: int, bits: int, dtype, rows: int, seed: int):
    """x [rows, K], the packed weights and the float32 truth x @ dequantize(w).T."""
    mx.random.seed(seed)
    weight, scales, biases = mx.quantize(
        mx.random.normal((n, k)) * 0.05, group_size=group_size, bits=bits
    )
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    packed = kernels.pack(weight, scales, biases, group_size, bits)
    assert packed.scale_bias.dtype == dtype
    dense = mx.dequantize(
        weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits
    )
    x = mx.random.normal((rows, k))
    expected = x @ dense.T
    mx.eval(packed.weight, packed.scale_bias, x, expected)
    return x, packed, np.array(expected)


def _assert_close(got: mx.array, expected: np.ndarray, what: object) -> None:
    # float32 sums of K products in another order (and the bias factored out of each block):
    # the error grows with the size of the sums, so it is held to their scale.
    error = np.abs(np.array(got) - expected).max()
    assert error <= 2e-5 * np.abs(expected).max() + 1e-6, (what, error)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-q{s[3]}")
def test_qmatmul_on_each_isa_equals_mlx_at_model_shapes(kernel_isa: str, shape) -> None:
    n, k, group_size, bits, dtype = shape
    x, packed, expected = _case(n, k, group_size, bits, dtype, max(ROWS), seed=k + bits)
    for rows in ROWS:
        got = kernels.qmatmul(x[:rows], packed)
        assert got.shape == (rows, n)
        _assert_close(got, expected[:rows], (kernel_isa, shape, rows))


@pytest.fixture(scope="module")
def lm_head():
    """Llama 3's vocabulary as the tied output projection of a 576-wide model (8 bits, as
    SmolLM2's embedding): 128,256 outputs, 8,016 tiles."""
    return _case(128_256, 576, 32, 8, mx.float16, 40, seed=7)


def test_qmatmul_on_each_isa_computes_a_128k_vocabulary_head(kernel_isa: str, lm_head) -> None:
    x, packed, expected = lm_head
    for rows in (1, 8, 40):  # decode alone, a decode batch, a prefill chunk's last rows
        _assert_close(kernels.qmatmul(x[:rows], packed), expected[:rows], (kernel_isa, rows))


def test_the_best_isa_this_cpu_runs_is_the_default() -> None:
    assert kernels.available()
    assert kernels.isas()[-1] == "generic"  # runs anywhere, so always runnable
    script = "from mlxd import kernels; print(kernels.isa(), ','.join(kernels.isas()))"
    env = {k: v for k, v in os.environ.items() if k != kernels.ISA_ENV}
    chosen, runnable = _python(script, env).split()
    assert chosen == runnable.split(",")[0]


def test_mlxd_kernels_isa_forces_a_variant_or_refuses_clearly() -> None:
    script = "from mlxd import kernels; print(kernels.isa())"
    for name in kernels.isas():
        assert _python(script, {**os.environ, kernels.ISA_ENV: name}) == name
    refused = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, kernels.ISA_ENV: "sse1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0
    assert "MLXD_KERNELS_ISA=sse1" in refused.stderr and "not built" in refused.stderr
    with pytest.raises(ValueError, match="not built"):
        kernels.use_isa("sse1")


def test_an_isa_the_cpu_lacks_is_refused() -> None:
    missing = [name for name in kernels.built_isas() if name not in kernels.isas()]
    if not missing:
        pytest.skip("not applicable here: this CPU runs every variant built for it")
    with pytest.raises(ValueError, match="this CPU lacks"):
        kernels.use_isa(missing[0])


def _python(script: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()
