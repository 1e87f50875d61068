"""One mixture-of-experts layer on the CPU: mlxd's packed gather matmul against MLX's.

python -m benchmarks.moe [--batches 1,8,32] [--prefill 512] [--experts 128] [--bits 4]
                         [--isas avx512,avx2] [--threads N] [--no-float32]

A SwitchGLU shaped like Qwen3-30B-A3B's (hidden 2,048, expert intermediate 768, 128 experts,
top 8; random weights quantized by MLX at 4 bits, groups of 64, as mlx-community's 4-bit
recipe), called as qwen3_moe calls it, with each token's experts drawn at random: ms per call
(fastest round; the machine is shared) at decode batches and one prefill chunk for

- packed: the layer as the CPU engine loads it (models/packed.py's `PackedSwitchLinear`, the
  kernels' gather matmul, csrc/gather_qmatmul.cpp), per ISA variant this CPU runs;
- int8: the same in the int8 dot-product layout (csrc/gather_qdot.cpp, precise), which the
  load picks where its timing finds the dot products faster, per variant that has them;
- gather_qmm: mlx-lm's `QuantizedSwitchLinear`, MLX's own quantized gather matmul;
- float32: the experts dequantized to float32 and multiplied by MLX's `gather_mm`
  (8x the bytes of 4-bit: what running the experts "float32 on BLAS" would mean).

The kernels use every core (`--threads`), as in a process whose models all run packed; each
path is timed over every row count before the next, float32 (OpenBLAS) last. Runs with mlxd.accel's
environment (the script re-executes itself), as the engine does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.profile_step import best_ms  # noqa: E402
from mlxd.accel import ensure_optimized_blas  # noqa: E402

HIDDEN, INTERMEDIATE, TOP_K = 2048, 768, 8


def build(experts: int, bits: int, group_size: int):
    """(mlx-lm's quantized SwitchGLU, its packed twin, the twin in the int8 dot-product layout
    or None where the kernels have no integer dot product)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

    from mlxd import kernels
    from mlxd.models.packed import pack_model

    def quantized() -> SwitchGLU:
        mx.random.seed(0)
        glu = SwitchGLU(8, 8, 1)  # projections replaced below, one at a time (memory)
        for name, (k, n) in {
            "gate_proj": (HIDDEN, INTERMEDIATE),
            "up_proj": (HIDDEN, INTERMEDIATE),
            "down_proj": (INTERMEDIATE, HIDDEN),
        }.items():
            layer = QuantizedSwitchLinear(k, n, experts, False, group_size, bits)
            mx.eval(layer.parameters())
            setattr(glu, name, layer)
        glu.set_dtype(mx.float32)  # scales as the loader leaves them on the CPU
        return glu

    reference, packed = quantized(), quantized()
    pack_model(packed)
    dot = None
    if kernels.integer_dot():
        dot = quantized()
        pack_model(dot, dot=True)
    return reference, packed, dot


def float32_twin(reference):
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    glu = SwitchGLU(8, 8, 1)
    for name in ("gate_proj", "up_proj", "down_proj"):
        q = getattr(reference, name)
        layer = SwitchLinear(8, 8, 1, bias=False)
        layer.weight = mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits)
        mx.eval(layer.weight)
        setattr(glu, name, layer)
    return glu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--isas", default="", help="ISA variants (default: every one it runs)")
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (default: all)")
    parser.add_argument("--no-float32", action="store_true")
    args = parser.parse_args()
    ensure_optimized_blas("benchmarks.moe")

    import mlx.core as mx

    from mlxd import kernels

    if not kernels.available():
        sys.exit("mlxd's CPU kernels are not built: python -m mlxd.kernels.build")
    mx.set_default_device(mx.cpu)
    threads = args.threads or len(os.sched_getaffinity(0))
    kernels.set_threads(threads)
    reference, packed, dot = build(args.experts, args.bits, args.group_size)
    isas = args.isas.split(",") if args.isas else kernels.isas()
    cases = {}
    for tokens in [int(b) for b in args.batches.split(",")] + [args.prefill]:
        x = mx.random.normal((1, tokens, HIDDEN), key=mx.random.key(tokens))
        scores = mx.random.uniform(shape=(1, tokens, args.experts), key=mx.random.key(1))
        cases[tokens] = (x, mx.argsort(scores, axis=-1)[..., :TOP_K])
        mx.eval(*cases[tokens])

    def ms(layer, tokens: int) -> float:
        x, indices = cases[tokens]
        repeat, rounds = (1, 3) if tokens == args.prefill else (5, 5)
        return best_ms(lambda: layer(x, indices), repeat, rounds)

    # Each path over every row count in turn, BLAS last: OpenBLAS's threads spin a while after
    # each call, and the kernels' threads would spin against them (csrc/threads.h).
    columns: dict[str, dict[int, float]] = {}
    for isa in isas:
        kernels.use_isa(isa)
        columns[f"packed {isa}"] = {tokens: ms(packed, tokens) for tokens in cases}
        if dot is not None and kernels.integer_dot():
            columns[f"int8 {isa}"] = {tokens: ms(dot, tokens) for tokens in cases}
    kernels.use_isa(isas[0])
    columns["gather_qmm"] = {tokens: ms(reference, tokens) for tokens in cases}
    if not args.no_float32:
        dense = float32_twin(reference)
        columns["float32"] = {tokens: ms(dense, tokens) for tokens in cases}
    print(
        f"one SwitchGLU: hidden {HIDDEN}, intermediate {INTERMEDIATE}, {args.experts} experts, "
        f"top {TOP_K}, {args.bits}-bit groups of {args.group_size}; kernels on {threads} "
        "threads; ms per call (fastest round)"
    )
    print(" | ".join(["tokens", *columns, "gather_qmm / packed", "float32 / packed"]))
    for tokens in cases:
        best = columns[f"packed {isas[0]}"][tokens]
        cells = [f"{tokens} ({'prefill' if tokens == args.prefill else 'decode'})"]
        cells += [f"{column[tokens]:.2f}" for column in columns.values()]
        cells.append(f"{columns['gather_qmm'][tokens] / best:.1f}x")
        if "float32" in columns:
            cells.append(f"{columns['float32'][tokens] / best:.1f}x")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
