"""mlxd's CPU kernels against the MLX ops they replace, and whole SmolLM2 steps packed vs float32.

python -m benchmarks.kernels [--batches 1,8,32] [--context 128]

Each op at the shapes one SmolLM2 decode step uses (per call, ms, fastest round; the machine
is shared), then a 512-token prefill chunk's attention, then whole forward passes of the model
loaded as the CPU engine loads it (packed 4/8-bit weights on the kernels) and dequantized to
float32 on OpenBLAS (what the engine ran before), in this one process. Runs with mlxd.accel's
environment (the script re-executes itself), as the engine does. Compare ratios: absolute
figures depend on the CPU and on what else it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.profile_step import best_ms, reexec_with_blas  # noqa: E402


def op_rows(model, batch: int, context: int) -> list[tuple[str, Callable, Callable]]:
    """(name, MLX's op, the kernel) at one decode step's shapes."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd.models.kernel_layers import KernelRMSNorm, KernelRoPE, kernel_attention

    args = model.args
    hidden, heads, kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    head_dim = hidden // heads
    up = model.model.layers[0].mlp.up_proj
    x = mx.random.normal((batch, 1, hidden))
    q = mx.random.normal((batch, 1, heads, head_dim)).transpose(0, 2, 1, 3)
    k = mx.random.normal((batch, kv_heads, context, head_dim))
    v = mx.random.normal((batch, kv_heads, context, head_dim))
    dense = mx.random.normal((up.output_dims, up.input_dims))
    rope = nn.RoPE(head_dim, traditional=True, base=100000.0)
    norm = nn.RMSNorm(hidden)
    kernel_rope, kernel_norm = KernelRoPE(rope), KernelRMSNorm(norm)
    mask = mx.ones((batch, 1, 1, context), dtype=mx.bool_)
    mx.eval(x, q, k, v, dense, mask)
    return [
        ("matmul 1,536 × 576 (float32 BLAS | packed 4-bit)", lambda: x @ dense.T, lambda: up(x)),
        (
            "rope (queries)",
            lambda: rope(q, offset=context),
            lambda: kernel_rope(q, offset=context),
        ),
        ("RMSNorm", lambda: norm(x), lambda: kernel_norm(x)),
        (
            f"attention (kv {context}, batch mask)",
            lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask),
            lambda: kernel_attention(q, k, v, cache=None, scale=0.125, mask=mask),
        ),
    ]


def prefill_attention(model, rows: int, keys: int) -> tuple[float, float]:
    import mlx.core as mx

    from mlxd.models.kernel_layers import kernel_attention

    args = model.args
    head_dim = args.hidden_size // args.num_attention_heads
    q = mx.random.normal((1, rows, args.num_attention_heads, head_dim)).transpose(0, 2, 1, 3)
    k = mx.random.normal((1, args.num_key_value_heads, keys, head_dim))
    v = mx.random.normal((1, args.num_key_value_heads, keys, head_dim))
    mx.eval(q, k, v)
    return (
        best_ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")),
        best_ms(lambda: kernel_attention(q, k, v, cache=None, scale=0.125, mask="causal")),
    )


def step_ms(model, batch: int, context: int, rounds: int) -> float:
    """A decode step (one token per row after `context` cached), median of `rounds`."""
    import statistics
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((batch, context), dtype=mx.int32), cache=cache))
    token = mx.zeros((batch, 1), dtype=mx.int32)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append((time.perf_counter() - started) * 1e3)
        for layer in cache:  # stay at `context`
            layer.trim(1)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    reexec_with_blas("benchmarks.kernels")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    args = parser.parse_args(argv)

    from benchmarks.compare import cpu_model, resolve_model_dir
    from mlxd import kernels
    from mlxd.accel import describe
    from mlxd.models.loader import load_llm

    if not kernels.available():
        print("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
        return 1
    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    packed = load_llm(model_dir, dtype="auto", model_name="smol")
    print(describe())
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")
    batches = [int(b) for b in args.batches.split(",")]
    layers = len(packed.model.model.layers)
    print(
        f"\nper call, ms: MLX op | kernel (speed-up), kv length {args.context}; each timed as "
        f"{layers} calls in one evaluation, as a step's layers run (alone, dispatch dominates)"
    )
    for b in batches:
        for name, mlx_op, kernel_op in op_rows(packed.model, b, args.context):
            before = best_ms(lambda op=mlx_op: [op() for _ in range(layers)]) / layers
            after = best_ms(lambda op=kernel_op: [op() for _ in range(layers)]) / layers
            print(f"batch {b:>2}  {name:<50} {before:8.3f} | {after:8.3f} ({before / after:.1f}x)")
    for rows, keys in ((512, 512), (512, 1536), (24, 1528)):
        before, after = prefill_attention(packed.model, rows, keys)
        print(
            f"prefill attention, {rows} rows × {keys} keys (causal)"
            f"{'':<12} {before:8.3f} | {after:8.3f} ({before / after:.1f}x)"
        )
    steps = {b: step_ms(packed.model, b, args.context, args.rounds) for b in batches}
    # The float32 model last: it turns the kernels' threads off for this process (see
    # kernels.share_cores), as a worker with a float32 model does.
    float32 = load_llm(model_dir, dtype="float32", model_name="smol")
    print(f"\nwhole decode step, ms (median of {args.rounds}; kv length {args.context})")
    print(
        f"weights: packed {packed.dtype} {packed.nbytes / 1e6:.0f} MB, float32 "
        f"{float32.nbytes / 1e6:.0f} MB"
    )
    for b in batches:
        before = step_ms(float32.model, b, args.context, args.rounds)
        print(
            f"batch {b:>2}: float32 on OpenBLAS {before:6.1f} | packed on the kernels "
            f"{steps[b]:6.1f} ({before / steps[b]:.2f}x; {1000 * b / steps[b]:.0f} tok/s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
