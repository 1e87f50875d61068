"""The KV cache in float16 on the CPU kernel path (`cache.kv_dtype`, default float16): what the
loader decides, what the cache holds, and that a real model's greedy tokens do not change."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import make_prompt_cache

from mlxd import kernels
from mlxd.models.kernel_layers import KernelAttention, kernel_attention, use_kernel_attention
from mlxd.models.loader import LoadedModel
from tests.unit.test_kernel_layers import tiny


def attention_layers(model) -> list[KernelAttention]:
    return [m for _, m in model.named_modules() if isinstance(m, KernelAttention)]


def greedy(model, prompt: list[int], tokens: int) -> tuple[list[int], mx.array, list]:
    """`tokens` greedy tokens after `prompt` (prefill, then one decode step each), the logits
    that chose them, and the cache."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    chosen, rows = [], []
    for _ in range(tokens):
        last = logits[:, -1, :]
        token = mx.argmax(last, axis=-1)
        chosen.append(token.item())
        rows.append(last)
        logits = model(token[:, None], cache=cache)
    return chosen, mx.concatenate(rows), cache


@contextmanager
def float32_kv(model) -> Iterator[None]:
    """`model` (the same weights) with its KV cache in float32 for the block's length."""
    layers = attention_layers(model)
    kept = [layer.kv_dtype for layer in layers]
    for layer in layers:
        layer.kv_dtype = None
    try:
        yield
    finally:
        for layer, dtype in zip(layers, kept, strict=True):
            layer.kv_dtype = dtype


def test_the_cpu_engine_stores_smollm2_kv_in_float16(smol_packed: LoadedModel) -> None:
    assert smol_packed.kv_dtype == "float16"
    assert all(layer.kv_dtype == mx.float16 for layer in attention_layers(smol_packed.model))
    _, _, cache = greedy(smol_packed.model, [1, 2, 3, 4, 5], 2)
    assert all(c.keys.dtype == c.values.dtype == mx.float16 for c in cache)


def test_smollm2_greedy_tokens_are_those_of_a_float32_kv_cache(smol_packed: LoadedModel) -> None:
    """Measured: the first 200 greedy tokens of this prompt agree, logits within 0.016 of
    float32 KV's (their scale: ≈40); the test takes 48 and a bound of 0.1."""
    tokenizer = smol_packed.tokenizer
    prompt = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Write a short story about a lighthouse keeper who finds a message "
                "in a bottle. Describe the sea, the weather and the keeper's feelings.",
            }
        ],
        add_generation_prompt=True,
    )
    half_tokens, half_logits, cache = greedy(smol_packed.model, prompt, 48)
    assert cache[0].keys.dtype == mx.float16
    with float32_kv(smol_packed.model):
        full_tokens, full_logits, cache = greedy(smol_packed.model, prompt, 48)
    assert cache[0].keys.dtype == mx.float32
    assert half_tokens == full_tokens
    assert mx.abs(half_logits - full_logits).max().item() < 0.1


def test_a_tiny_model_with_a_float16_cache_keeps_its_logits() -> None:
    """Prefill and decode through the cache: float16 keys and values, logits near float32's,
    on the kernel and on MLX's fallback (which casts the cache back to the queries' dtype)."""
    if not kernels.available():
        pytest.skip("mlxd's CPU kernels are not built (python -m mlxd.kernels.build)")
    reference = tiny("qwen3")
    use_kernel_attention(reference)
    model = tiny("qwen3")
    use_kernel_attention(model, mx.float16)
    prompt = [5, 17, 33, 2, 90, 64, 7, 11, 40, 3]
    expected_tokens, expected, _ = greedy(reference, prompt, 6)
    tokens, logits, cache = greedy(model, prompt, 6)
    assert all(c.keys.dtype == mx.float16 for c in cache)
    assert cache[0].offset == len(prompt) + 6
    assert tokens == expected_tokens
    assert mx.allclose(logits, expected, atol=1e-2).item()

    # MLX's attention (no kernel) over a float16 cache: what a quantized or sink path takes.
    queries = mx.random.normal((1, 4, 1, 16))
    keys, values = cache[0].keys_and_values()
    wide = scaled_dot_product_attention(
        queries, keys.astype(mx.float32), values.astype(mx.float32), None, scale=0.25, mask=None
    )
    sinks = mx.full((4,), -1e9)  # a sink that takes no weight: MLX's path, same result
    got = kernel_attention(queries, keys, values, None, 0.25, None, sinks=sinks)
    assert got.dtype == mx.float32
    assert mx.allclose(got, wide, atol=1e-5).item()
