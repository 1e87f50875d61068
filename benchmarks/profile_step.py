"""Where a decode step's time goes on the MLX CPU backend, by op type, and the step A/B.

python -m benchmarks.profile_step --batches 1,8,32 --context 128

Runs as the engine does: float32 weights, the optimized BLAS preloaded (the script re-executes
itself with mlxd.accel's environment). Each op is timed alone at the shapes one decode step of
the model uses (summed over its layers), evaluated on its own: the per-op figures include MLX's
dispatch per op, so their sum exceeds a fused step. With --batch1, every matmul of a step in
each weight format (float32/bfloat16/float16/q8/q4, OpenBLAS threads). Then whole steps are timed
A/B in this one process, interleaved in short turns (median step): mlx-lm's stock
`BatchGenerator` with the exact SiLU against mlxd's `BatchExecutor` with the exact and the
rational SiLU. Report ratios; absolute figures depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from mlxd.accel import ensure_optimized_blas  # noqa: E402


def best_ms(fn: Callable[[], object], repeat: int = 10, rounds: int = 7) -> float:
    """Fastest round's mean time of `repeat` evaluated calls, in ms (the least disturbed one:
    the machine is shared)."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            mx.eval(fn())
        times.append((time.perf_counter() - started) / repeat * 1e3)
    return min(times)


def op_table(model, tokenizer, batch: int, context: int) -> list[tuple[str, float]]:
    import mlx.core as mx
    from mlx_lm.models.activations import swiglu

    from mlxd.models.activations import swiglu_rational

    args = model.args
    layers = len(model.model.layers)
    hidden, inter, vocab = args.hidden_size, args.intermediate_size, args.vocab_size
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = hidden // heads
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = mx.random.normal((batch, 1, hidden))
    g = mx.random.normal((batch, 1, inter))
    q = mx.random.normal((batch, heads, 1, head_dim))
    k = mx.random.normal((batch, kv_heads, context, head_dim))
    v = mx.random.normal((batch, kv_heads, context, head_dim))
    logits = mx.random.normal((batch, vocab)) * 4
    mx.eval(x, g, q, k, v, logits)
    embed = model.model.embed_tokens
    lm_head = getattr(model, "lm_head", None) or embed.as_linear
    detok = [tokenizer.detokenizer for _ in range(batch)]
    token_ids = [int(t) for t in mx.random.randint(100, 20000, (8,)).tolist()]

    def detokenize() -> None:
        for d in detok:
            for t in token_ids:
                d.add_token(t)
                _ = d.last_segment

    def python_ms(fn: Callable[[], None], repeat: int = 5) -> float:
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - started) / repeat / len(token_ids) * 1e3

    def sdpa():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=head_dim**-0.5)

    return [
        ("matmul q/k/v/o", layers * best_ms(lambda: [attn.q_proj(x), attn.k_proj(x),
                                                      attn.v_proj(x), attn.o_proj(x)])),
        ("matmul gate/up/down", layers * best_ms(lambda: [mlp.gate_proj(x), mlp.up_proj(x),
                                                           mlp.down_proj(g)])),
        ("matmul lm_head", best_ms(lambda: lm_head(x))),
        ("SiLU*up exact (mlx-lm swiglu)", layers * best_ms(lambda: swiglu(g, g))),
        ("SiLU*up rational (mlxd)", layers * best_ms(lambda: swiglu_rational(g, g))),
        ("RMSNorm (2/layer + final)", (2 * layers + 1) * best_ms(lambda: layer.input_layernorm(x))),
        ("rope (q and k)", layers * best_ms(lambda: [attn.rope(q), attn.rope(q[:, :kv_heads])])),
        (f"attention sdpa (kv {context})", layers * best_ms(sdpa)),
        ("logsumexp over vocab", best_ms(lambda: logits - mx.logsumexp(logits, -1, keepdims=True))),
        ("softmax over vocab", best_ms(lambda: mx.softmax(logits, axis=-1))),
        ("argmax over vocab", best_ms(lambda: mx.argmax(logits, axis=-1))),
        ("embedding lookup", best_ms(lambda: embed(mx.zeros((batch, 1), mx.int32)))),
        ("detokenize (python, all rows)", python_ms(detokenize)),
    ]  # fmt: skip


def batch1_matmuls(model, batches: tuple[int, ...] = (1, 8)) -> list[tuple[str, list[float]]]:
    """ms for every matmul of one decode step (one layer's seven x 30, plus lm_head) in each
    weight format MLX's CPU backend offers, and float32 with OpenBLAS on 1 thread."""
    import ctypes

    import mlx.core as mx

    from mlxd.accel import find_optimized_blas

    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    mats = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
    weights = [m.weight for m in mats] + [mlp.down_proj.weight]
    head = getattr(model, "lm_head", None) or model.model.embed_tokens
    layers = len(model.model.layers)

    def step_ms(batch: int, matmul: Callable, prepared: list, prepared_head) -> float:
        xs = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
        mx.eval(list(xs.values()))
        pairs = list(zip(weights, prepared, strict=True))
        # Few repeats: the slow formats take seconds per step.
        per_layer = best_ms(lambda: [matmul(xs[w.shape[1]], p) for w, p in pairs], 2, 3)
        lm = best_ms(lambda: matmul(xs[head.weight.shape[1]], prepared_head), 2, 3)
        return layers * per_layer + lm

    def dense(dtype):
        prepared = [w.astype(dtype) for w in weights]
        prepared_head = head.weight.astype(dtype)
        mx.eval(prepared, prepared_head)
        return (lambda x, w: x.astype(w.dtype) @ w.T), prepared, prepared_head

    def quantized(bits: int):
        def prep(w):
            return mx.quantize(w, group_size=32, bits=bits)

        prepared = [prep(w) for w in weights]
        prepared_head = prep(head.weight)
        mx.eval(prepared, prepared_head)

        def matmul(x, packed):
            return mx.quantized_matmul(x, *packed, transpose=True, group_size=32, bits=bits)

        return matmul, prepared, prepared_head

    variants = {
        "float32": lambda: dense(mx.float32),
        "bfloat16": lambda: dense(mx.bfloat16),
        "float16": lambda: dense(mx.float16),
        "q8 (quantized_matmul)": lambda: quantized(8),
        "q4 (quantized_matmul)": lambda: quantized(4),
    }
    rows = []
    for name, make in variants.items():
        matmul, prepared, prepared_head = make()
        rows.append((name, [step_ms(b, matmul, prepared, prepared_head) for b in batches]))
    blas = find_optimized_blas()
    set_threads = getattr(ctypes.CDLL(blas), "openblas_set_num_threads", None) if blas else None
    if set_threads is not None:
        matmul, prepared, prepared_head = dense(mx.float32)
        set_threads(1)
        rows.append(("float32, OpenBLAS 1 thread", [step_ms(b, matmul, prepared, prepared_head)
                                                    for b in batches]))  # fmt: skip
        set_threads(os.cpu_count() or 1)
    return rows


def step_ab(
    model, batch: int, context: int, rounds: int, steps: int, cpu_time: bool
) -> dict[str, float]:
    """ms per decode step (median over interleaved turns): stock generator + exact SiLU vs
    fast generator, exact and rational SiLU."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.generate import BatchGenerator

    from mlxd.executor.batch import BatchExecutor, NewRow
    from mlxd.executor.sampling import GREEDY
    from mlxd.models.activations import RationalSwiGLU, use_rational_swiglu
    from mlxd.scheduler import Chunk
    from tests.unit.test_fast_decode import ExactSwiGLU

    def exact() -> None:
        swaps = [
            (n, ExactSwiGLU(m)) for n, m in model.named_modules() if isinstance(m, RationalSwiGLU)
        ]
        if swaps:
            model.update_modules(tree_unflatten(swaps))

    prompts = [mx.random.randint(100, 20000, (context,)).tolist() for _ in range(batch)]
    uids = list(range(batch))

    def stock() -> Callable[[], object]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch,
                             prefill_batch_size=batch)  # fmt: skip
        gen.insert(prompts, max_tokens=[10**6] * batch, samplers=[GREEDY] * batch)
        while len(gen.next_generated()) < batch:
            pass  # prefilled, every row decoding
        return gen.next

    def fast() -> Callable[[], object]:
        executor = BatchExecutor(model, stop_tokens=[])
        executor.add([NewRow(uid, prompts[uid], 10**6, sampler=GREEDY) for uid in uids])
        executor.run([Chunk(uid, 0, context - 1) for uid in uids], [])
        return lambda: executor.run([], uids)

    variants = {
        "stock": (stock, exact),
        "fast step, exact SiLU": (fast, exact),
        "fast step + rational SiLU": (fast, lambda: use_rational_swiglu(model)),
    }
    generators = {}
    for name, (make, silu) in variants.items():  # prefill each once, then step them in turns
        silu()
        generators[name] = make()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (_, silu) in variants.items():
            silu()
            step = generators[name]
            step()  # the step in flight was computed with the other SiLU
            for _ in range(steps):
                # CPU time of this process (all its threads): on a shared machine wall time
                # mostly measures the other processes.
                started = time.process_time() if cpu_time else time.perf_counter()
                step()
                ended = time.process_time() if cpu_time else time.perf_counter()
                times[name].append((ended - started) * 1e3)
    # Median over many short interleaved turns: load from other processes hits every variant.
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ensure_optimized_blas("benchmarks.profile_step")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=128, help="KV length during the steps")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--cpu-time", action="store_true", help="step A/B in process CPU time")
    parser.add_argument("--batch1", action="store_true", help="also compare weight formats")
    args = parser.parse_args(argv)

    from benchmarks.compare import machine, resolve_model_dir
    from mlxd.accel import describe
    from mlxd.models.loader import load_llm

    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    loaded = load_llm(model_dir, dtype="float32", model_name="smol")
    print(describe())
    print(f"{machine()}; load average {os.getloadavg()[0]:.1f}")
    batches = [int(b) for b in args.batches.split(",")]
    if not args.skip_ops:
        tables = {b: op_table(loaded.model, loaded.tokenizer, b, args.context) for b in batches}
        print(f"\nper decode step, ms (ops timed alone; kv length {args.context})")
        print(f"{'op':<34}" + "".join(f"{f'batch {b}':>10}" for b in batches))
        for index, (name, _) in enumerate(tables[batches[0]]):
            print(f"{name:<34}" + "".join(f"{tables[b][index][1]:>10.2f}" for b in batches))
    turns = f"{args.rounds} interleaved turns of {args.steps} steps"
    print(f"\nwhole decode step, ms (median over {turns})")
    print("(CPU ms of this process per step)" if args.cpu_time else "(wall ms per step)")
    for b in batches:
        result = step_ab(loaded.model, b, args.context, args.rounds, args.steps, args.cpu_time)
        stock = result["stock"]
        print(
            f"batch {b:>2}: "
            + ", ".join(f"{name} {ms:.1f} ({stock / ms:.2f}x)" for name, ms in result.items())
        )
    if args.batch1:
        print("\nall matmuls of one decode step, ms, by weight format")
        for name, figures in batch1_matmuls(loaded.model):
            print(f"{name:<30}" + "".join(f"{f:>10.2f}" for f in figures) + "  (batch 1, 8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
