"""The collectives of one decode step, timed alone: what splitting a model costs per step in
communication, whatever the compute. Run on every rank of a group:

    mlx.launch --backend ring -n 3 -- python -m mlxd.distributed.timing --model-dir DIR \
        --strategy tensor

Rank 0 prints `{"comm_ms": …}` (a JSON line). benchmarks/distributed.py runs it beside its
serving runs; tests/distributed_rank.py times the same thing after its generation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

REPEATS = 3  # on a busy 2-core machine one tensor-parallel step's 60 all_sums take seconds


def communication_ms(
    config: dict[str, Any], strategy: str, group: mx.distributed.Group, batch: int
) -> float | None:
    """Milliseconds of one decode step's collectives for `batch` sequences, replayed on arrays
    of the decode shape: tensor parallel all_sums twice per layer (attention and MLP outputs);
    a pipeline sends the hidden states once per stage boundary and all_gathers them once.
    None for a group of one."""
    if group.size() == 1:
        return None
    hidden = mx.zeros((batch, 1, config["hidden_size"]), dtype=mx.float32)
    rank, size = group.rank(), group.size()

    def one_step() -> None:
        if strategy == "tensor":
            outs = [
                mx.distributed.all_sum(hidden + i, group=group)
                for i in range(2 * config["num_hidden_layers"])
            ]
            mx.eval(outs)
            return
        h = hidden
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=group)
        if rank != 0:
            h = mx.distributed.send(h + 1, rank - 1, group=group)
        mx.eval(mx.distributed.all_gather(h, group=group))

    one_step()  # warm-up: first-use setup of the arrays and connections
    tick = time.perf_counter()
    for _ in range(REPEATS):
        one_step()
    return round((time.perf_counter() - tick) / REPEATS * 1000, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlxd.distributed.timing")
    parser.add_argument("--model-dir", type=Path, required=True, help="has the config.json")
    parser.add_argument("--strategy", choices=("tensor", "pipeline"), required=True)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    args = parser.parse_args(argv)
    config = json.loads((args.model_dir / "config.json").read_text(encoding="utf-8"))
    group = mx.distributed.init(strict=True)
    result = communication_ms(config, args.strategy, group, args.batch)
    if group.rank() == 0:
        print(json.dumps({"comm_ms": result, "ranks": group.size(), "batch": args.batch}))


if __name__ == "__main__":
    main()
