"""mlxd's CPU kernels on every ISA variant this machine runs (csrc/simd.h, csrc/dispatch.cpp):
the packed matmul against MLX's dequantize + matmul at real model shapes and the sampling
kernel against its rule in float64, on two threads, and the dispatch itself (the best variant
by default, MLXD_KERNELS_ISA forcing one)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxd import kernels
from tests import nucleus_reference

# (N outputs, K inputs, group size, bits, scale dtype): every K of the models mlxd serves
# (SmolLM2 576, Llama-3.2-1B 2048, 8B 4096 and its MLP's 14,336, 8,192), every group size
# and width; float16 scales as a GGUF's, float32 as an MLX-quantized float32 model's. 160
# outputs: 10 one-tile work items, claimed in an odd number of chunks (5 of 2) by two threads.
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


def _case(n: int, k: int, group_size: int, bits: int, dtype, rows: int, seed: int, pack=None):
    """x [rows, K], the weights packed by `pack` (kernels.pack by default), the float32 truth
    x @ dequantize(w).T and dequantize(w)."""
    mx.random.seed(seed)
    weight, scales, biases = mx.quantize(
        mx.random.normal((n, k)) * 0.05, group_size=group_size, bits=bits
    )
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    packed = (pack or kernels.pack)(weight, scales, biases, group_size, bits)
    assert packed.scale_bias.dtype == dtype
    dense = mx.dequantize(
        weight, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits
    )
    x = mx.random.normal((rows, k))
    expected = x @ dense.T
    mx.eval(packed.weight, packed.scale_bias, x, expected, dense)
    return x, packed, np.array(expected), np.array(dense)


def _assert_close(got: mx.array, expected: np.ndarray, what: object) -> None:
    # float32 sums of K products in another order (and the bias factored out of each block):
    # the error grows with the size of the sums, so it is held to their scale.
    error = np.abs(np.array(got) - expected).max()
    assert error <= 2e-5 * np.abs(expected).max() + 1e-6, (what, error)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-q{s[3]}")
def test_qmatmul_on_each_isa_equals_mlx_at_model_shapes(kernel_isa: str, shape) -> None:
    n, k, group_size, bits, dtype = shape
    x, packed, expected, _ = _case(n, k, group_size, bits, dtype, max(ROWS), seed=k + bits)
    for rows in ROWS:
        got = kernels.qmatmul(x[:rows], packed)
        assert got.shape == (rows, n)
        _assert_close(got, expected[:rows], (kernel_isa, shape, rows))


@pytest.fixture(scope="module")
def lm_head():
    """Llama 3's vocabulary as the tied output projection of a 576-wide model (8 bits, as
    SmolLM2's embedding): 128,256 outputs, 8,016 tiles."""
    return _case(128_256, 576, 32, 8, mx.float16, 40, seed=7)[:3]


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


# Rows for the integer dot-product path (decode): one pass of 1-8 rows (AVX-512: 8 per pass,
# AVX2 and NEON 4, generic 2), several passes with a remainder, a short prefill chunk.
DOT_ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 33)


def _int8_x(x: np.ndarray, precise: bool) -> tuple[np.ndarray, np.ndarray]:
    """x as csrc/qdot.cpp rounds it, per row and block of 32 in float32 as the kernel: llama.cpp's
    Q8 (d = max |x| / 127, x8 = round(x / d)) and, precise, the rest in steps of d / 254; the
    rounded x [rows, K] and the step of its last term [rows, K / 32, 1]."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.maximum(largest, 1e-30), 0)
    inverse = inverse.astype(np.float32)
    step = largest / np.float32(127)
    x8 = np.rint(blocks * inverse)
    rounded = x8.astype(np.float64) * step
    if precise:
        rest = np.clip(np.rint((blocks - x8 * step) * inverse * np.float32(254)), -127, 127)
        step = step / np.float32(254)
        rounded += rest * step
    return rounded.reshape(x.shape), step


def _assert_dot_close(got, x: mx.array, dense: np.ndarray, expected: np.ndarray, precise, what):
    """The integer path against (1) its own arithmetic in float64: x rounded as the kernel
    rounds it times the weights, held to float32's tolerance, and (2) MLX's float32 truth
    within the rounding's worst case: each x_k moves at most half a step of its last term
    (d / 2, or d / 508 when precise), so output n moves at most sum_k |w_nk| step_k / 2."""
    rounded, step = _int8_x(np.array(x), precise)
    _assert_close(got, rounded @ dense.astype(np.float64).T, what)
    steps = np.broadcast_to(step / 2, (*step.shape[:2], 32)).reshape(x.shape)
    worst = np.abs(dense) @ steps.T
    excess = np.abs(np.array(got) - expected) - worst.T - 2e-5 * np.abs(expected).max()
    assert excess.max() <= 0, (what, excess.max())


@pytest.mark.parametrize("precise", [False, True], ids=["int8", "precise"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-q{s[3]}")
def test_integer_dot_product_on_each_isa_equals_mlx_at_model_shapes(
    kernel_isa: str, shape, precise: bool
) -> None:
    n, k, group_size, bits, dtype = shape

    def pack(*args) -> kernels.Packed:
        return kernels.pack_dot(*args, precise=precise)

    x, packed, expected, dense = _case(n, k, group_size, bits, dtype, max(DOT_ROWS), k + bits, pack)
    assert packed.dot and kernels.integer_dot() == (kernel_isa not in ("generic", "neon"))
    for rows in DOT_ROWS:
        got = kernels.qmatmul(x[:rows], packed)
        assert got.shape == (rows, n)
        what = (kernel_isa, shape, rows)
        _assert_dot_close(got, x[:rows], dense, expected[:rows], precise, what)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}-g{s[2]}-q{s[3]}")
def test_the_int8_layout_runs_the_float_paths_buffered_passes_from_its_rows(
    kernel_isa: str, shape
) -> None:
    """`set_dot_buffer_rows(33)`: over 33 rows and more a matrix in the int8 layout gives the
    float layout's very floats (its weights dequantized into the same buffer), below that
    the integer dot products' rounding."""
    n, k, group_size, bits, dtype = shape
    x, packed, expected, dense = _case(n, k, group_size, bits, dtype, 70, k + bits, kernels.pack)
    mx.random.seed(k + bits)  # the same weights again, in the int8 layout
    weight, scales, biases = mx.quantize(
        mx.random.normal((n, k)) * 0.05, group_size=group_size, bits=bits
    )
    dot = kernels.pack_dot(weight, scales.astype(dtype), biases.astype(dtype), group_size, bits)
    kernels.set_dot_buffer_rows(33)
    try:
        for rows in (8, 32, 33, 70):
            got = kernels.qmatmul(x[:rows], dot)
            mx.eval(got)  # the rows are read as the matmul runs
            what = (kernel_isa, shape, rows)
            if rows < 33:
                _assert_dot_close(got, x[:rows], dense, expected[:rows], False, what)
            else:
                float_layout = kernels.qmatmul(x[:rows], packed)
                assert np.array_equal(np.array(got), np.array(float_layout)), what
    finally:
        kernels.set_dot_buffer_rows(0)


def test_integer_dot_product_on_each_isa_computes_a_128k_vocabulary_head(kernel_isa: str):
    """Llama 3's vocabulary at Llama-3.2-1B's width, 4 bits as a Q4 GGUF's head."""
    x, packed, expected, dense = _case(128_256, 2048, 32, 4, mx.float16, 8, 11, kernels.pack_dot)
    precise = kernels.Packed(packed.weight, packed.scale_bias, 4, dot=True, precise=True)
    for rows in (1, 8):
        for layout in (packed, precise):
            got = kernels.qmatmul(x[:rows], layout)
            what = (kernel_isa, rows, layout.precise)
            _assert_dot_close(got, x[:rows], dense, expected[:rows], layout.precise, what)


def test_a_zero_block_of_x_and_the_extreme_weights_stay_exact() -> None:
    """x with an all-zero block (d = 0) and weights at 0 and 2^bits - 1, where maddubs's pair
    sums would saturate without the offset (csrc/qdot.cpp); x exact in int8 (a rest of 0), then
    x halfway between int8 steps (precise's rest at its bound, +-127 of 254ths), so that
    254 x8 sums + rest sums take their largest magnitude."""
    for bits in (4, 8):
        top = 2**bits - 1
        q = mx.array(np.where(np.arange(64 * 64).reshape(64, 64) % 3 == 0, top, 0), mx.float32)
        weight, scales, biases = mx.quantize(q, group_size=32, bits=bits)
        packed = kernels.pack_dot(weight, scales, biases, 32, bits, precise=True)
        x = mx.concatenate([mx.zeros((2, 32)), mx.full((2, 32), 127.0)], axis=1)
        halfway = np.full((2, 64), 126.5, np.float32)
        halfway[:, ::32] = 127.0  # each block's largest: its step 1, 126.5 at half a step
        x = mx.concatenate([x, mx.array(halfway)]) * mx.array([[1.0], [-1.0], [1.0], [-1.0]])
        expected = np.array(x @ mx.dequantize(weight, scales, biases, 32, bits).T)
        before = kernels.isa() or "generic"
        try:
            for isa in kernels.isas():
                kernels.use_isa(isa)
                got = np.array(kernels.qmatmul(x, packed))
                assert np.allclose(got, expected, rtol=1e-5, atol=1e-3), (isa, bits)
        finally:
            kernels.use_isa(before)


# Logits a sampling kernel meets: a trained model's (a peaked head over a long tail), a random
# model's (flat: its nucleus most of the vocabulary, split again and again), all equal, ties
# (integers), and masked tokens (-inf: never drawn; one row with three finite tokens).
def _logit_rows(vocab: int, rows: int = 33) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(vocab)
    masked = rng.normal(0, 5, (rows, vocab))
    masked[rng.random((rows, vocab)) < 0.5] = -np.inf
    masked[0] = -np.inf
    masked[0, [5, 77, vocab - 1]] = [1.0, 1.0, -80.0]
    kinds = {
        "peaked": rng.normal(0, 5, (rows, vocab)),
        "wide": rng.normal(0, 0.1, (rows, vocab)),
        "flat": np.zeros((rows, vocab)),
        "tied": np.round(rng.normal(0, 3, (rows, vocab))),
        "masked": masked,
    }
    return {kind: logits.astype(np.float32) for kind, logits in kinds.items()}


TOP_P = (0.5, 0.9, 0.95, 1.0)  # row r's: TOP_P[r % 4], TEMPERATURES[r % 5]
TEMPERATURES = (0.3, 0.7, 1.0, 1.5, 1.1)
UNIFORMS = np.concatenate([[0.0], np.random.default_rng(1).random(10), [1 - 2**-24]])
UNIFORMS = UNIFORMS.astype(np.float32)  # with 0 and the float32 just below 1


@functools.cache
def _sampling_case(vocab: int, kind: str):
    """The logits [33, vocab] and, per row, the reference's draw for each of UNIFORMS."""
    logits = _logit_rows(vocab)[kind]
    expected = [
        nucleus_reference.draws(
            logits[r],
            float(np.float32(1 / TEMPERATURES[r % 5])),
            TOP_P[r % 4],
            [float(u) for u in UNIFORMS],
        )
        for r in range(logits.shape[0])
    ]
    return logits, expected


@pytest.mark.parametrize("vocab", [49_152, 50_257, 128_256])
def test_argmax_on_each_isa_is_mlx_argmax(kernel_isa: str, vocab: int) -> None:
    """Temperature 0 through the sampling kernel: mx.argmax's token, the first of equal maxima
    (the tied and flat rows), a masked row's, and 0 for a row with every token masked."""
    rows = _logit_rows(vocab)
    edges = np.full((3, vocab), -np.inf, np.float32)  # every token masked
    edges[1, vocab - 1] = 2.0  # the maximum in the last, partial vector (vocab 50,257)
    edges[2, [vocab - 3, vocab - 2]] = 2.0  # a tie there
    for kind, logits in [*rows.items(), ("edges", edges)]:
        got = np.array(kernels.argmax(mx.array(logits)))
        want = np.array(mx.argmax(mx.array(logits), axis=-1))
        assert np.array_equal(got, want), (kernel_isa, kind, np.flatnonzero(got != want)[:5])
    assert np.array(kernels.argmax(mx.array(edges))).tolist() == [0, vocab - 1, vocab - 3]
    assert np.array(kernels.argmax(mx.array(rows["masked"][:1]))).tolist() == [5]


@pytest.mark.parametrize("vocab", [49_152, 50_257, 128_256])  # 50,257: not whole vectors
@pytest.mark.parametrize("kind", ["peaked", "wide", "flat", "tied", "masked"])
def test_sample_on_each_isa_draws_as_the_float64_rule(kernel_isa: str, vocab: int, kind: str):
    logits, expected = _sampling_case(vocab, kind)
    rows = logits.shape[0]
    scale = mx.array([1 / TEMPERATURES[r % 5] for r in range(rows)], dtype=mx.float32)
    top_p = mx.array([TOP_P[r % 4] for r in range(rows)], dtype=mx.float32)

    def sample(first: int, last: int, u: float) -> np.ndarray:
        uniform = mx.full((last - first,), u)
        rows = slice(first, last)
        return np.array(kernels.sample(mx.array(logits[rows]), scale[rows], top_p[rows], uniform))

    sure = 0
    for k, u in enumerate(UNIFORMS):
        got = sample(0, rows, float(u))
        for r in range(rows):
            want = expected[r][k]
            what = (kernel_isa, kind, r, TOP_P[r % 4], TEMPERATURES[r % 5], float(u))
            if want.sure:
                assert got[r] == want.token, (*what, int(got[r]), want.token)
                sure += 1
            else:  # within rounding of a boundary: either side, but never outside the nucleus
                assert want.allowed[got[r]], (*what, int(got[r]), want.token)
        # The same draws in batches of 1, 2 and 7 rows (other splits over the threads).
        batches = [(0, 1), (1, 3), (3, 10)]
        assert np.array_equal(np.concatenate([sample(*b, float(u)) for b in batches]), got[:10])
    # Most draws are clear of every boundary (all-equal logits put one every 1/vocab).
    assert sure >= 0.4 * rows * len(UNIFORMS)
