"""mlxd's CPU kernels against the MLX ops they replace, and whole SmolLM2 steps packed vs float32.

python -m benchmarks.kernels [--batches 1,8,32] [--context 128] [--isas avx2,generic]
                            [--int8-only] [--kv-only]

For each ISA variant of the kernels this CPU runs (csrc/simd.h; the dispatch's own choice
first): each op at the shapes one SmolLM2 decode step uses (per call, ms, fastest round; the
machine is shared), a 512-token prefill chunk's attention, and whole forward passes of the
model loaded as the CPU engine loads it (packed 4/8-bit weights on the kernels); then the
same model dequantized to float32 on OpenBLAS (what the engine ran before), in this one
process, and a table of the packed/float32 ratios per ISA. First, per ISA, the quantized
matmul by integer dot products (int8 x, csrc/qdot.cpp) against the float path and float32
BLAS at decode rows, on SmolLM2's and Llama-3.2-1B's matmul shapes (random weights;
`--int8-only`: that table alone). Then, per ISA, the attention kernel over a float16 KV cache
against float32 (cache.kv_dtype) at decode (KV length 128/1024/4096) and prefill, and the
memory a long SmolLM2 context's KV takes in each (`--kv-only`: those alone). Runs with mlxd.accel's
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

from benchmarks.profile_step import best_ms  # noqa: E402
from mlxd.accel import ensure_optimized_blas  # noqa: E402


def op_rows(model, batch: int, context: int) -> list[tuple[str, Callable, Callable]]:
    """(name, MLX's op, the kernel) at one decode step's shapes."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd.models.kernel_layers import KernelRMSNorm, KernelRoPE, kernel_attention

    args = model.args
    hidden, heads, kv_heads = args.hidden_size, args.num_attention_heads, args.num_key_value_heads
    head_dim = hidden // heads
    mlp = model.model.layers[0].mlp
    # (a packed load runs gate and up as one matmul: models/fused.py)
    up = mlp.gate_up_proj.split()[1] if "gate_up_proj" in mlp else mlp.up_proj
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


# (op, N outputs, K inputs, bits): SmolLM2-135M's matmuls (its tied head 8-bit, as its GGUF
# and MLX quantization keep it) and Llama-3.2-1B's (MLP N = 8,192, head N = 128,256).
DOT_SHAPES = [
    ("SmolLM2 q/o 576 × 576", 576, 576, 4),
    ("SmolLM2 k/v 192 × 576", 192, 576, 4),
    ("SmolLM2 gate/up 1,536 × 576", 1536, 576, 4),
    ("SmolLM2 down 576 × 1,536", 576, 1536, 4),
    ("SmolLM2 head 49,152 × 576 (8-bit)", 49152, 576, 8),
    ("Llama-1B q/o 2,048 × 2,048", 2048, 2048, 4),
    ("Llama-1B k/v 512 × 2,048", 512, 2048, 4),
    ("Llama-1B gate/up 8,192 × 2,048", 8192, 2048, 4),
    ("Llama-1B down 2,048 × 8,192", 2048, 8192, 4),
    ("Llama-1B head 128,256 × 2,048", 128256, 2048, 4),
]
DOT_ROWS = (1, 4, 8)


def dot_ms(isas: list[str], threads: int | None) -> None:
    """Per op and row count: float32 BLAS, then per ISA the float path, the int8 path and the
    precise int8 path (x as two int8 terms) in ms per call (fastest round), and the int8 and
    precise paths' speed-ups over the float path (and the int8 path's over BLAS)."""
    print(
        "\nquantized matmul, ms per call: float32 BLAS | per ISA: packed float, int8 dot, "
        "precise int8 dot (speed-ups over packed float; int8's over BLAS)"
    )
    for name, n, k, bits in DOT_SHAPES:
        for line in dot_lines(name, n, k, bits, isas, threads):
            print(line, flush=True)


def dot_lines(name: str, n: int, k: int, bits: int, isas: list[str], threads: int | None):
    import mlx.core as mx

    from mlxd import kernels

    dense = mx.random.normal((n, k)) * 0.05
    weight, scales, biases = mx.quantize(dense, group_size=32, bits=bits)
    packed = kernels.pack(weight, scales, biases, 32, bits)
    dot = kernels.pack_dot(weight, scales, biases, 32, bits)
    precise = kernels.Packed(dot.weight, dot.scale_bias, bits, dot=True, precise=True)
    mx.eval(dense)
    for rows in DOT_ROWS:
        x = mx.random.normal((rows, k))
        mx.eval(x)
        blas = best_ms(lambda: x @ dense.T)  # noqa: B023 (timed before x changes)
        line = f"{name:<34} rows {rows}: BLAS {blas:7.3f}"
        for isa in isas:
            kernels.use_isa(isa)
            if threads:
                kernels.set_threads(threads)
            float_path = best_ms(lambda: kernels.qmatmul(x, packed))  # noqa: B023
            int8_path = best_ms(lambda: kernels.qmatmul(x, dot))  # noqa: B023
            precise_path = best_ms(lambda: kernels.qmatmul(x, precise))  # noqa: B023
            line += (
                f" | {isa} {float_path:.3f} {int8_path:.3f} {precise_path:.3f}"
                f" ({float_path / int8_path:.2f}x {float_path / precise_path:.2f}x,"
                f" BLAS {blas / int8_path:.1f}x)"
            )
        yield line


# (name, query heads, kv heads, head dim, layers): SmolLM2-135M's attention and Llama-3.1-8B's.
KV_SHAPES = [("SmolLM2", 9, 3, 64, 30), ("Llama-8B", 32, 8, 128, 32)]
KV_LENGTHS = (128, 1024, 4096)


def kv_dtype_ms(isas: list[str], threads: int | None) -> None:
    """Per ISA and shape: the attention kernel's ms per layer with float32 and float16 keys and
    values, at decode (batch 1 and 8) and for a 512-row prefill chunk (causal)."""
    import mlx.core as mx

    from mlxd import kernels

    print("\nattention kernel, ms per layer: float32 KV | float16 KV (speed-up), fastest round")
    for isa in isas:
        kernels.use_isa(isa)
        if threads:
            kernels.set_threads(threads)
        for name, heads, kv_heads, dim, layers in KV_SHAPES:
            cases = [(f"decode batch {b}, kv {n}", b, 1, n) for b in (1, 8) for n in KV_LENGTHS]
            cases += [(f"prefill 512 rows, kv {n}", 1, 512, n) for n in (512, 2048)]
            for label, batch, rows, keys in cases:
                q = mx.random.normal((batch, heads, rows, dim))
                k, v = (mx.random.normal((batch, kv_heads, keys, dim)) for _ in range(2))
                half_k, half_v = k.astype(mx.float16), v.astype(mx.float16)
                mx.eval(q, k, v, half_k, half_v)
                repeat = max(1, min(layers, 4096 // keys))  # a step's layers, in one evaluation

                def run(keys_, values_, repeat=repeat, q=q):
                    return [
                        kernels.attention(q, keys_, values_, 0.125, "causal") for _ in range(repeat)
                    ]

                # A prefill chunk runs for long enough that fewer rounds tell as much.
                times = {"repeat": 1, "rounds": 3} if rows > 1 else {}
                full = best_ms(lambda k=k, v=v, run=run: run(k, v), **times) / repeat
                half = best_ms(lambda k=half_k, v=half_v, run=run: run(k, v), **times) / repeat
                print(
                    f"[{isa}] {name:<8} {label:<26} {full:8.3f} | {half:8.3f} ({full / half:.2f}x)",
                    flush=True,
                )


def store_kv_as(model, dtype) -> None:
    """The model's KernelAttention layers store their KV in `dtype` (None: float32)."""
    from mlxd.models.kernel_layers import KernelAttention

    for _, module in model.named_modules():
        if isinstance(module, KernelAttention):
            module.kv_dtype = dtype


def kv_steps(model, rounds: int) -> None:
    """Whole SmolLM2 decode steps with float32 and float16 KV at a short and a long context
    (batches 1 and 8: each first prefills batch × context tokens)."""
    import mlx.core as mx

    print(f"\nwhole decode step, ms (median of {rounds}): float32 KV | float16 KV")
    for context in (128, 2048):
        for batch in (1, 8):
            store_kv_as(model, None)
            full = step_ms(model, batch, context, rounds)
            store_kv_as(model, mx.float16)
            half = step_ms(model, batch, context, rounds)
            print(
                f"batch {batch}, kv {context:>4}: {full:7.2f} | {half:7.2f} ({full / half:.2f}x)",
                flush=True,
            )


def kv_memory(model_dir: Path, tokens: int) -> None:
    """A `tokens`-long SmolLM2 context with its KV in float32, then float16, each in a process
    of its own (a process's RSS keeps what it freed): `kv_memory_here`'s line for each."""
    import subprocess

    print(f"\nKV of one {tokens}-token SmolLM2 context (prefilled in chunks of 512)", flush=True)
    for dtype in ("float32", "float16"):
        argv = [sys.executable, "-m", "benchmarks.kernels", "--kv-memory", dtype]
        argv += ["--kv-tokens", str(tokens), "--model-dir", str(model_dir)]
        subprocess.run(argv, check=True)


def kv_memory_here(model_dir: Path, dtype: str, tokens: int) -> None:
    """Load SmolLM2 as the engine does with `cache.kv_dtype: dtype`, prefill `tokens` tokens
    and print the cache's bytes, the RSS it added and MLX's peak over the load."""
    import mlx.core as mx
    import psutil
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.models.loader import load_llm

    model = load_llm(model_dir, dtype="auto", model_name="smol", kv_dtype=dtype).model
    process = psutil.Process()
    mx.clear_cache()
    before, active = process.memory_info().rss, mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model)
    for start in range(0, tokens, 512):
        ids = mx.arange(start, start + 512, dtype=mx.int32)[None] % 1000 + 100
        mx.eval(model(ids, cache=cache)[:, -1])
    held = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    grown = process.memory_info().rss - before
    peak = mx.get_peak_memory() - active
    print(
        f"{dtype}: cache arrays {held / 2**20:6.1f} MiB ({cache[0].keys.dtype}), RSS grew "
        f"{grown / 2**20:6.1f} MiB, MLX peak above the weights {peak / 2**20:6.1f} MiB"
    )


def op_ms(model, batch: int, context: int, layers: int) -> list[tuple[str, float, float]]:
    """(op, MLX's ms, the kernel's ms) per call, each timed as `layers` calls in one evaluation,
    as a step's layers run (alone, dispatch dominates)."""
    rows = []
    for name, mlx_op, kernel_op in op_rows(model, batch, context):
        before = best_ms(lambda op=mlx_op: [op() for _ in range(layers)]) / layers
        after = best_ms(lambda op=kernel_op: [op() for _ in range(layers)]) / layers
        rows.append((name, before, after))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--isas", default=None, help="ISA variants to run (default: every one)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="kernel and OpenBLAS threads (default: every core; 1 gives steadier per-core "
        "figures on a busy shared machine, where threads wait on each other)",
    )
    parser.add_argument(
        "--int8-only", action="store_true", help="only the integer dot-product path's table"
    )
    parser.add_argument(
        "--kv-only", action="store_true", help="only the float16 vs float32 KV tables"
    )
    parser.add_argument(
        "--kv-tokens", type=int, default=8192, help="the KV memory's context (0: skip)"
    )
    parser.add_argument("--kv-memory", default=None, help=argparse.SUPPRESS)  # kv_memory's child
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    args = parser.parse_args(argv)
    if args.threads:
        os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    ensure_optimized_blas("benchmarks.kernels")

    from benchmarks.compare import machine, resolve_model_dir
    from mlxd import kernels
    from mlxd.accel import describe
    from mlxd.models.loader import load_llm

    if not kernels.available():
        print("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
        return 1
    if args.kv_memory:
        kv_memory_here(args.model_dir, args.kv_memory, args.kv_tokens)
        return 0
    chosen = kernels.isa()
    isas = args.isas.split(",") if args.isas else kernels.isas()
    print(describe())
    print(f"{machine()}; load average {os.getloadavg()[0]:.1f}")
    print(f"threads: {args.threads or 'every core'}")
    print(
        f"kernel ISAs: built {kernels.built_isas()}, this CPU runs {kernels.isas()}; "
        f"the dispatch chose {chosen}"
    )
    if not args.kv_only:
        dot_ms(isas, args.threads)
    if args.int8_only:
        return 0
    kv_dtype_ms(isas, args.threads)
    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    packed = load_llm(model_dir, dtype="auto", model_name="smol")
    kernels.use_isa(chosen or isas[0])
    if args.kv_tokens:
        kv_memory(model_dir, args.kv_tokens)
    kv_steps(packed.model, args.rounds)
    if args.kv_only:
        return 0
    kernels.use_isa(chosen or isas[0])
    if args.threads:
        kernels.set_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    layers = len(packed.model.model.layers)
    ops: dict[str, dict[int, list[tuple[str, float, float]]]] = {}
    steps: dict[str, dict[int, float]] = {}
    for isa in isas:
        kernels.use_isa(isa)
        print(f"\n[{isa}] per call, ms: MLX op | kernel (speed-up), kv length {args.context}")
        ops[isa] = {}
        for b in batches:
            ops[isa][b] = op_ms(packed.model, b, args.context, layers)
            for name, before, after in ops[isa][b]:
                print(
                    f"batch {b:>2}  {name:<50} {before:8.3f} | {after:8.3f} ({before / after:.2f}x)"
                )
        for rows, keys in ((512, 512), (512, 1536), (24, 1528)):
            before, after = prefill_attention(packed.model, rows, keys)
            print(
                f"prefill attention, {rows} rows × {keys} keys (causal)"
                f"{'':<12} {before:8.3f} | {after:8.3f} ({before / after:.2f}x)"
            )
        steps[isa] = {b: step_ms(packed.model, b, args.context, args.rounds) for b in batches}
    kernels.use_isa(chosen or isas[0])
    # The float32 model last: it turns the kernels' threads off for this process (see
    # kernels.share_cores), as a worker with a float32 model does.
    float32 = load_llm(model_dir, dtype="float32", model_name="smol")
    if args.threads:
        kernels.set_threads(args.threads)
    print(f"\nwhole decode step, ms (median of {args.rounds}; kv length {args.context})")
    print(
        f"weights: packed {packed.dtype} {packed.nbytes / 1e6:.0f} MB, float32 "
        f"{float32.nbytes / 1e6:.0f} MB"
    )
    reference = {b: step_ms(float32.model, b, args.context, args.rounds) for b in batches}
    for b in batches:
        line = f"batch {b:>2}: float32 on OpenBLAS {reference[b]:6.1f}"
        for isa in isas:
            line += f" | {isa} {steps[isa][b]:6.1f} ({reference[b] / steps[isa][b]:.2f}x)"
        print(line)
    print("\nspeed-up over float32 (MLX's op on OpenBLAS), per ISA: ops, then the whole step")
    for b in batches:
        for i, (name, _, _) in enumerate(ops[isas[0]][b]):
            ratios = "  ".join(
                f"{isa} {ops[isa][b][i][1] / ops[isa][b][i][2]:5.2f}x" for isa in isas
            )
            print(f"batch {b:>2}  {name:<50} {ratios}")
        ratios = "  ".join(f"{isa} {reference[b] / steps[isa][b]:5.2f}x" for isa in isas)
        print(f"batch {b:>2}  {'whole decode step':<50} {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
