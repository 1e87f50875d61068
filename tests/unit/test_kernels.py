"""mlxd's CPU kernels (csrc/) against MLX's own ops: the packed matmul against dequantize +
matmul, RoPE, RMSNorm and attention against mx.fast, the sampling op's inputs; and a real
quantized model run packed against the same model dequantized to float32."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxd import kernels
from mlxd.models.kernel_layers import KernelRMSNorm, KernelRoPE, kernel_attention
from mlxd.models.packed import PackedEmbedding, PackedLinear


def test_the_kernels_are_built_and_load() -> None:
    # `make` builds them (python -m mlxd.kernels.build); without them the CPU runs float32.
    assert kernels.available(), "mlxd's CPU kernels did not build: python -m mlxd.kernels.build"


def test_a_module_built_from_older_sources_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib
    import types

    from mlxd.kernels import _cpu

    # Everything a build of the day before had: all but the newest binding.
    newest = "map_file_arrays"
    stale = types.SimpleNamespace(**{n: getattr(_cpu, n) for n in dir(_cpu) if n != newest})
    monkeypatch.setattr(importlib, "import_module", lambda name: stale)
    assert kernels._load() is None
    assert f"older sources (no {newest})" in caplog.text
    monkeypatch.undo()
    assert kernels._load() is not None


def _reference(x: mx.array, weight: mx.array, scales, biases, group_size: int, bits: int):
    # In float32, as the kernel computes (float16 scales would round each weight to float16).
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    w = mx.dequantize(weight, scales, biases, group_size=group_size, bits=bits)
    return x.astype(mx.float32) @ w.T


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


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dot", [False, True])
def test_take_rows_reads_each_layout_exactly(bits: int, dot: bool) -> None:
    # A tied embedding's lookups read the table its output projection multiplies by.
    weight, scales, biases = mx.quantize(mx.random.normal((96, 128)), group_size=64, bits=bits)
    packed = (kernels.pack_dot if dot else kernels.pack)(weight, scales, biases, 64, bits)
    table = mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32), 64, bits)
    ids = mx.array([[0, 17, 95], [31, 32, 48]])
    assert mx.array_equal(kernels.take_rows(packed, ids), table[ids]).item()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_scale_and_bias_serve_the_models_group(group: int) -> None:
    # One pair per 64 inputs for a model quantized in 64s (4.5 bits a 4-bit weight, not 5).
    weight, scales, biases = mx.quantize(mx.random.normal((32, 384)), group_size=group, bits=4)
    x = mx.random.normal((3, 384))
    expected = x @ mx.dequantize(weight, scales, biases, group, 4).T
    for dot in (False, True):
        if dot:
            packed = kernels.pack_dot(weight, scales, biases, group, 4, precise=True)
        else:
            packed = kernels.pack(weight, scales, biases, group, 4)
        assert packed.group == kernels.scale_group(group) == group
        assert packed.scale_bias.shape == (2, 384 // group, 2, 16)
        error = mx.abs(kernels.qmatmul(x, packed) - expected).max().item()
        assert error < 1e-4 * mx.abs(expected).max().item(), (dot, error)


def test_a_group_the_kernels_cannot_step_is_served_in_its_largest_part_they_can() -> None:
    assert [kernels.scale_group(g) for g in (96, 160, 192, 256)] == [32, 32, 64, 256]


def test_pack_refuses_what_the_kernel_cannot_run() -> None:
    weight, scales, biases = mx.quantize(mx.random.normal((48, 64)), group_size=32, bits=4)
    assert not kernels.packable(weight.shape[0], 32, 4)  # 48 output rows: tiles are 32
    with pytest.raises(ValueError, match="cannot pack"):
        kernels.pack(weight, scales, biases, 32, 4)
    three_bit = mx.quantize(mx.random.normal((64, 64)), group_size=32, bits=3)[0]
    assert not kernels.packable(three_bit.shape[0], 32, 3)


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


def test_packed_layers_start_computing_as_built_with_the_same_arithmetic(smol_packed) -> None:
    """Each decoder layer schedules its input once built (KernelAttention.eager); taking the
    scheduling away changes no logit."""
    from mlxd.models.kernel_layers import KernelAttention
    from mlxd.models.layer_eval import evaluate_per_layer

    layers = smol_packed.model.layers
    attentions = [layer.self_attn for layer in layers]
    assert all(isinstance(a, KernelAttention) and a.eager for a in attentions)
    assert evaluate_per_layer(smol_packed.model) == len(layers)  # idempotent
    ids = mx.array([smol_packed.tokenizer.encode("The capital of France is")])
    scheduled = smol_packed.model(ids)
    for attention in attentions:
        attention.eager = False
    try:
        assert mx.array_equal(smol_packed.model(ids), scheduled).item()
    finally:
        for attention in attentions:
            attention.eager = True


def test_packed_attention_splits_and_rotates_in_one_node(smol_packed, tmp_path) -> None:
    """A packed layer's fused q/k/v output is split, rotated and cast for its float16 cache by
    one kernel call, bit for bit what the separate steps give; a decode step's graph then has
    no transposes or separate rotations left (each was a node and a dispatch)."""
    import re

    from mlx_lm.models.cache import make_prompt_cache

    model = smol_packed.model
    cache = make_prompt_cache(model)
    ids = mx.array([smol_packed.tokenizer.encode("The capital of France is")])
    mx.eval(model(ids, cache=cache))
    attention = model.layers[3].self_attn
    assert attention.kv_dtype == mx.float16
    x = mx.random.normal((2, 3, model.args.hidden_size))
    for offset, layer_cache in (
        (0, cache[3]),
        (cache[3].offset, cache[3]),
        (mx.array([4, 90], dtype=mx.int32), cache[3]),
        (0, None),  # no cache: k and v stay float32
    ):
        rotated = attention._project_rotated(x, offset, layer_cache)
        assert rotated is not None
        separate = attention._project_each(x, offset, layer_cache)
        for got, want in zip(rotated, separate, strict=True):
            assert got.dtype == want.dtype and mx.array_equal(got, want).item()
        assert rotated[1].dtype == (mx.float32 if layer_cache is None else mx.float16)
    for layer in model.layers:
        layer.self_attn.eager = False
    try:
        step = model(ids[:, :1], cache=cache)
        mx.export_to_dot(str(tmp_path / "step.dot"), step)
    finally:
        for layer in model.layers:
            layer.self_attn.eager = True
    nodes = re.findall(r'label ="([A-Za-z]+)"', (tmp_path / "step.dot").read_text())
    assert nodes.count("RoPEQKVCPU") == len(model.layers)
    assert "RoPECPU" not in nodes and "Transpose" not in nodes, sorted(set(nodes))


def test_only_the_engine_thread_runs_kernels_on_several_threads() -> None:
    """One multi-threaded stream per process (csrc/threads.h): once a thread is the engine's,
    kernels evaluated on another thread's stream run on one thread, with the same results. In
    a process of its own: the choice is process-wide."""
    script = """
import os, threading
import mlx.core as mx
from mlxd import kernels
weight, scales, biases = mx.quantize(mx.random.normal((256, 256)), group_size=32, bits=4)
packed = kernels.pack(weight, scales, biases, 32, 4)
x = mx.random.normal((64, 256))
mx.eval(packed.weight, packed.scale_bias, x)
kernels.share_cores(packed=True)
seen = {}
def run(name, engine):
    if engine:
        kernels.parallelize_this_thread()
    y = kernels.qmatmul(x, packed)
    mx.eval(y)
    seen[name] = (kernels._module().threads_here(), y)
for name, engine in (("engine", True), ("other", False)):
    thread = threading.Thread(target=run, args=(name, engine))
    thread.start()
    thread.join()
assert seen["engine"][0] == len(os.sched_getaffinity(0)), seen["engine"][0]
assert seen["other"][0] == 1, seen["other"][0]
assert mx.array_equal(seen["engine"][1], seen["other"][1]).item()
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def _greedy(model: nn.Module, ids: mx.array, tokens: int = 24) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache, out, x = make_prompt_cache(model), [], ids
    for _ in range(tokens):
        token = mx.argmax(model(x, cache=cache)[:, -1], axis=-1)
        out.append(token.item())
        x = token[None]
    return out


def _rope_float64(x: mx.array, dims: int, traditional: bool, offsets: np.ndarray) -> np.ndarray:
    """RoPE computed in float64 with numpy: the truth both MLX and the kernel approximate."""
    a = np.array(x, dtype=np.float64)
    positions = offsets[:, None] + np.arange(a.shape[2])  # [B, L]
    # The float32 frequencies the kernel is given (KernelRoPE): in float64, 4,000 positions
    # times their rounding moved the truth ≈1e-4 from both MLX and the kernel, by chance.
    exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
    inv_freq = np.array(mx.power(mx.array(100000.0, mx.float32), -exponents), dtype=np.float64)
    theta = positions[:, None, :, None] * inv_freq  # [B, 1, L, dims / 2]
    first, second = (
        (a[..., 0:dims:2], a[..., 1:dims:2])
        if traditional
        else (a[..., : dims // 2], a[..., dims // 2 : dims])
    )
    cos, sin = np.cos(theta), np.sin(theta)
    out = a.copy()
    rotated = (first * cos - second * sin, first * sin + second * cos)
    if traditional:
        out[..., 0:dims:2], out[..., 1:dims:2] = rotated
    else:
        out[..., : dims // 2], out[..., dims // 2 : dims] = rotated
    return out


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims", [64, 32])
def test_rope_equals_mlx(traditional: bool, dims: int) -> None:
    rope = nn.RoPE(dims, traditional=traditional, base=100000.0)
    kernel = KernelRoPE(rope)
    contiguous = mx.random.normal((3, 9, 5, 64))
    strided = mx.random.normal((3, 5, 9, 64)).transpose(0, 2, 1, 3)  # as attention passes it
    for x in (contiguous, strided):
        for offset in (0, 17, mx.array([3, 100, 4000])):  # a batch's per-row offsets
            got = kernel(x, offset=offset)
            expected = mx.fast.rope(
                x, dims, traditional=traditional, base=100000.0, scale=1.0, offset=offset
            )
            # Both round the angle of a late position (≈5e-4 at 4000 for MLX's float32
            # angles): each is held to the float64 truth, the kernel no further than MLX.
            offsets = np.broadcast_to(np.array(offset), (x.shape[0],))
            truth = _rope_float64(x, dims, traditional, offsets)
            kernel_error = np.abs(np.array(got) - truth).max()
            mlx_error = np.abs(np.array(expected) - truth).max()
            assert kernel_error <= max(mlx_error, 1e-5), (kernel_error, mlx_error)


@pytest.mark.parametrize("traditional", [False, True])
def test_llama3_rope_runs_on_the_kernel_as_mlx_lm_computes_it(traditional: bool) -> None:
    # Llama 3.x's scaled frequencies, read off mlx-lm's module (Llama-3.2-1B's config).
    from mlx_lm.models.rope_utils import Llama3RoPE

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = Llama3RoPE(64, 131072, traditional, 500000.0, scaling)
    kernel = KernelRoPE(rope)
    x = mx.random.normal((3, 32, 2, 64))
    for offset in (0, 17, 9000, mx.array([3, 100, 60000])):
        got, expected = kernel(x, offset=offset), rope(x, offset=offset)
        # Both round a late position's angle in float32 (≈5e-3 apart at 60,000 here).
        largest = mx.max(mx.array(offset)).item()
        assert mx.allclose(got, expected, rtol=0, atol=1e-5 + 2e-7 * largest).item()
    half = x.astype(mx.float16)  # what the kernel does not take goes to mlx-lm's module
    assert mx.array_equal(kernel(half, offset=5), rope(half, offset=5)).item()
    # A greater error than the rounding of late angles: the frequencies are not Llama 3's.
    plain = KernelRoPE(nn.RoPE(64, traditional=traditional, base=500000.0))
    assert not mx.allclose(plain(x, offset=9000), rope(x, offset=9000), atol=1e-2).item()


@pytest.mark.parametrize(
    "heads",
    [
        # (q heads, kv heads, head dim, rotated dims): SmolLM2, Llama-3.2-1B, Llama-3.1-8B,
        # a partial rotation (the other features copied).
        (9, 3, 64, 64),
        (32, 8, 64, 64),
        (32, 8, 128, 128),
        (4, 2, 64, 32),
    ],
)
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_qkv_is_the_split_the_rotations_and_the_casts(
    heads: tuple[int, int, int, int], traditional: bool
) -> None:
    """One call does what KernelAttention's steps did: slice a fused projection's output into
    q, k and v, put heads first, rotate q and k, cast k and v to the cache's dtype; bit for
    bit, at decode rows and a prefill chunk, one offset or one per row."""
    h, kv, d, dims = heads
    rope = KernelRoPE(nn.RoPE(dims, traditional=traditional, base=500000.0))
    mx.random.seed(h + d + dims)
    for b, length in ((1, 1), (4, 1), (2, 37)):
        qkv = mx.random.normal((b, length, (h + 2 * kv) * d))
        for offset in (0, 1000, mx.array([7 * i for i in range(b)], dtype=mx.int32)):
            for stored in (mx.float32, mx.float16):
                q, k, v = rope.rotate_qkv(qkv, offset, (h, kv), stored)
                parts = [
                    part.reshape(b, length, count, d).transpose(0, 2, 1, 3)
                    for part, count in zip(
                        mx.split(qkv, [h * d, (h + kv) * d], axis=-1), (h, kv, kv), strict=True
                    )
                ]
                expected = [
                    rope(parts[0], offset=offset),
                    rope(parts[1], offset=offset).astype(stored),
                    parts[2].astype(stored),
                ]
                for got, want in zip((q, k, v), expected, strict=True):
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert mx.array_equal(got, want).item(), (heads, b, length, offset, stored)


def test_rope_qkv_refuses_what_does_not_fit() -> None:
    rope = KernelRoPE(nn.RoPE(64, traditional=False, base=10000.0))
    qkv = mx.zeros((1, 1, 15 * 64))
    with pytest.raises(ValueError, match="width"):
        rope.rotate_qkv(qkv, 0, (9, 4), mx.float32)  # 960 is not 17 heads' width
    with pytest.raises(ValueError, match="kv_dtype"):
        rope.rotate_qkv(qkv, 0, (9, 3), mx.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        rope.rotate_qkv(qkv.astype(mx.float16), 0, (9, 3), mx.float32)
    with pytest.raises(ValueError, match="do not fit"):
        wide = KernelRoPE(nn.RoPE(96, traditional=False, base=10000.0))
        wide.rotate_qkv(qkv, 0, (9, 3), mx.float32)  # 96 dims rotated in heads of 64


def test_rms_norm_equals_mlx(kernel_isa: str) -> None:
    norm = nn.RMSNorm(576, eps=1e-5)
    norm.weight = mx.random.normal((576,))
    kernel = KernelRMSNorm(norm)
    for x in (mx.random.normal((2, 7, 576)), mx.random.normal((576, 3)).T[:, None, :]):
        assert mx.allclose(kernel(x), norm(x), atol=1e-5).item()


def test_swiglu_equals_the_rational_one_and_silu(kernel_isa: str) -> None:
    from mlx_lm.models.activations import swiglu as exact

    from mlxd.models.activations import swiglu_rational

    gate, x = mx.random.normal((3, 7, 1536)) * 6, mx.random.normal((3, 7, 1536))
    strided = mx.random.normal((99, 5)).T * 6, mx.random.normal((99, 5)).T
    for g, v in ((gate, x), strided):
        got = kernels.swiglu(g, v)
        assert mx.allclose(got, swiglu_rational(g, v), atol=1e-5).item()
        assert mx.allclose(got, exact(g, v), atol=1e-5).item()


def test_swiglu_of_a_fused_outputs_halves_is_swiglu_of_the_two(kernel_isa: str) -> None:
    """A fused gate and up projection's output [..., 2F], gate first: the same values to the
    bit as the kernel given the two halves apart, a row's halves never mixed with another's."""
    both = mx.concatenate([mx.random.normal((3, 7, 1536)) * 6, mx.random.normal((3, 7, 1536))], -1)
    strided = mx.random.normal((2 * 96, 5)).T  # rows not contiguous: copied first
    for fused in (both, strided):
        half = fused.shape[-1] // 2
        got = kernels.swiglu_halves(fused)
        assert got.shape == (*fused.shape[:-1], half)
        assert mx.array_equal(got, kernels.swiglu(fused[..., :half], fused[..., half:])).item()
    with pytest.raises(ValueError, match="2F"):
        kernels.swiglu_halves(mx.zeros((2, 3)))


@pytest.mark.parametrize(
    "shape",
    [
        # (B, q heads, kv heads, query rows, keys, head dim): a kv head's decode rows together
        # against its keys as stored (group × rows < 8; a lone row alone), prefill and
        # verification rows in tiles over transposed keys (group × rows >= 8), odd sizes.
        (1, 9, 3, 1, 64, 64),
        (4, 9, 3, 1, 70, 64),
        (2, 28, 4, 1, 50, 128),
        (2, 4, 4, 1, 33, 64),
        (2, 9, 3, 5, 20, 64),
        (2, 4, 4, 7, 7, 80),
        (3, 9, 3, 16, 40, 64),
        (1, 2, 1, 33, 50, 32),
        # head dims 128 and 256, decode and prefill, keys not a whole number of vectors.
        (2, 32, 8, 1, 300, 128),
        (1, 8, 2, 24, 130, 128),
        (1, 8, 4, 1, 77, 256),
        (1, 4, 2, 12, 70, 256),
    ],
)
def test_attention_equals_mlx(kernel_isa: str, shape: tuple[int, ...]) -> None:
    b, hq, hkv, lq, lk, d = shape
    mx.random.seed(sum(shape))  # the same inputs every run
    q = mx.random.normal((b, lq, hq, d)).transpose(0, 2, 1, 3)
    k = mx.random.normal((b, hkv, lk + 5, d))[:, :, :lk]  # a cache's view: strided
    v = mx.random.normal((b, hkv, lk, d))
    masks = [
        None,
        "causal",
        mx.random.uniform(shape=(b, 1, lq, lk)) > 0.3,  # bool, as batch padding masks
        mx.random.normal((b, 1, lq, lk)),  # additive
        mx.random.uniform(shape=(lq, lk)) > 0.5,
    ]
    for mask in masks:
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        got = kernel_attention(q, k, v, cache=None, scale=0.125, mask=mask)
        # A row whose mask hides every key: MLX gives NaN, the kernel zeros.
        expected = mx.where(mx.isnan(expected), 0.0, expected)
        # Float32 sums in another order: a relative bound too (d = 256 terms per score).
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item(), (shape, mask)
        # Written heads last, as the output projection takes it: the same numbers.
        merged = kernel_attention(q, k, v, cache=None, scale=0.125, mask=mask, heads_last=True)
        heads_last = got.transpose(0, 2, 1, 3).reshape(b, lq, hq * d)
        assert mx.array_equal(merged, heads_last).item(), (shape, mask)
    # Row 0 sees no key: zeros, in a tile of rows too (where MLX averages every value).
    hidden = mx.broadcast_to(mx.arange(lq)[:, None] > 0, (lq, lk))
    got = kernel_attention(q, k, v, cache=None, scale=0.125, mask=hidden)
    assert not mx.any(got[:, :, 0]).item(), shape
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=hidden)
    assert mx.allclose(got[:, :, 1:], expected[:, :, 1:], rtol=1e-4, atol=1e-5).item(), shape


@pytest.mark.parametrize(
    "shape",
    [
        # (B, q heads, kv heads, query rows, keys, head dim): decode rows (KV lengths past a
        # vector's multiple), prefill tiles, GQA groups of 3 and 4, head dims 64/128/256 and
        # one (80) that is not a whole number of AVX-512 vectors.
        (4, 9, 3, 1, 129, 64),
        (2, 9, 3, 16, 40, 64),
        (2, 32, 8, 1, 300, 128),
        (1, 8, 2, 24, 130, 128),
        (1, 8, 4, 1, 77, 256),
        (1, 4, 2, 12, 70, 256),
        (2, 4, 4, 7, 7, 80),
        (1, 4, 1, 1, 33, 80),
        (1, 4, 2, 3, 21, 40),  # rows' tails (40 = 2 × 16 + 8) in the scalar conversion
    ],
)
def test_attention_reads_float16_keys_and_values(kernel_isa: str, shape: tuple[int, ...]) -> None:
    """A float16 KV cache: the kernel widens the halves as it reads (F16C, NEON, or the
    generic variant's scalar conversion) and computes in float32, so it equals MLX's attention
    over the same halves widened to float32, and stays float32 out."""
    b, hq, hkv, lq, lk, d = shape
    mx.random.seed(sum(shape) + 1)
    q = mx.random.normal((b, lq, hq, d)).transpose(0, 2, 1, 3)
    k = mx.random.normal((b, hkv, lk + 3, d)).astype(mx.float16)[:, :, :lk]  # a cache's view
    v = mx.random.normal((b, hkv, lk, d)).astype(mx.float16)
    wide_k, wide_v = k.astype(mx.float32), v.astype(mx.float32)
    for mask in (None, "causal", mx.random.uniform(shape=(b, 1, lq, lk)) > 0.3):
        expected = mx.fast.scaled_dot_product_attention(q, wide_k, wide_v, scale=0.125, mask=mask)
        expected = mx.where(mx.isnan(expected), 0.0, expected)
        got = kernel_attention(q, k, v, cache=None, scale=0.125, mask=mask)
        assert got.dtype == mx.float32
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item(), (shape, mask)
        # Its float32 path over the widened halves agrees: only the loads differ.
        assert mx.allclose(got, kernels.attention(q, wide_k, wide_v, 0.125, mask), atol=1e-5).item()


def test_attention_widens_every_float16_value_exactly(kernel_isa: str) -> None:
    """One key: its value comes out as it is, so each of the 65,536 half bit patterns
    (subnormals, infinities, NaNs) must widen to exactly MLX's float32 (the last few through
    the scalar conversion of a row's tail)."""
    every = mx.array(np.arange(2**16, dtype=np.uint16).view(np.float16))
    value = mx.concatenate([every, every[1:6]]).reshape(1, 1, 1, -1)
    q, k = mx.ones((1, 1, 1, 64)), mx.zeros((1, 1, 1, 64), dtype=mx.float16)
    got = np.array(kernels.attention(q, k, value, 0.125, None)).reshape(-1)
    expected = np.array(value.astype(mx.float32)).reshape(-1)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], expected[~nan])  # (-0 comes out 0: 0 + 1 × -0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_attention_reads_inputs_whose_last_axis_is_strided(dtype: mx.Dtype) -> None:
    """q, k and v transposed so their last axis steps over rows, and still lazy (an unevaluated
    array reports row order): the kernel learns their strides when it runs, and copies."""
    mx.random.seed(7)
    b, hq, hkv, lq, lk, d = 2, 4, 2, 3, 9, 64
    q = mx.random.normal((b, hq, d, lq)).swapaxes(2, 3)
    k = mx.random.normal((b, hkv, d, lk)).astype(dtype).swapaxes(2, 3)
    v = mx.random.normal((b, hkv, d, lk)).astype(dtype).swapaxes(2, 3)
    wide_k, wide_v = (a.astype(mx.float32) for a in (k, v))
    for mask in (None, mx.random.uniform(shape=(b, 1, lq, lk)) > 0.3):
        expected = mx.fast.scaled_dot_product_attention(q, wide_k, wide_v, scale=0.125, mask=mask)
        expected = mx.where(mx.isnan(expected), 0.0, expected)
        got = kernels.attention(q, k, v, 0.125, mask)
        assert mx.allclose(got, expected, rtol=1e-4, atol=1e-5).item(), mask


def test_attention_refuses_mixed_or_other_kv_dtypes() -> None:
    q = mx.random.normal((1, 2, 1, 64))
    k = mx.random.normal((1, 2, 4, 64))
    for keys, values in ((k.astype(mx.float16), k), (k.astype(mx.bfloat16),) * 2):
        with pytest.raises(ValueError, match="both float32 or both float16"):
            kernels.attention(q, keys, values, 0.125, None)
    # kernel_attention, mlx-lm's drop-in, sends those to MLX instead (cast to q's dtype).
    mixed = kernel_attention(q, k.astype(mx.bfloat16), k.astype(mx.bfloat16), None, 0.125, None)
    assert mixed.dtype == mx.float32


def test_assemble_kv_lays_the_blocks_out_per_layer_with_room() -> None:
    blocks = [mx.random.normal((3, 2, tokens, 8)) for tokens in (4, 4, 2)]
    layers = kernels.assemble_kv(blocks, 16)
    assert len(layers) == 3
    for layer, got in enumerate(layers):
        assert got.shape == (1, 2, 16, 8)
        expected = mx.concatenate([b[layer] for b in blocks], axis=1)
        assert mx.array_equal(got[0, :, :10], expected).item()
        assert not mx.any(got[0, :, 10:]).item()  # the room is zeros
    with pytest.raises(ValueError, match="capacity"):
        kernels.assemble_kv(blocks, 9)
    with pytest.raises(ValueError, match="layouts"):
        kernels.assemble_kv([blocks[0], mx.zeros((3, 2, 4, 4))], 16)


def test_sample_takes_half_and_strided_logits_and_refuses_other_shapes() -> None:
    """Logits in any float type (cast to float32), or transposed and still lazy (their strides
    known only when the op runs, which copies them into row order), draw as float32 rows."""
    logits = mx.random.normal((4, 3000), key=mx.random.key(3)) * 4
    scale, top_p = mx.array([1.0, 1.4, 0.8, 3.0]), mx.array([0.9, 0.5, 1.0, 0.95])
    uniform = mx.array([0.1, 0.5, 0.7, 0.99])
    expected = kernels.sample(logits, scale, top_p, uniform)
    assert expected.dtype == mx.uint32 and expected.shape == (4,)
    for dtype in (mx.float16, mx.bfloat16):
        rounded = logits.astype(dtype)
        assert kernels.sample(rounded, scale, top_p, uniform).tolist() == (
            kernels.sample(rounded.astype(mx.float32), scale, top_p, uniform).tolist()
        )
    strided = mx.contiguous(logits.T).T  # row-major data read column by column
    assert kernels.sample(strided, scale, top_p, uniform).tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"logits \[n, V\]"):
        kernels.sample(logits[0], scale, top_p, uniform)
    with pytest.raises(ValueError, match=r"must be \[n\]"):
        kernels.sample(logits, scale[:3], top_p, uniform)
