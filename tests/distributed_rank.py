"""One rank of the distributed tests: `mlx.launch --backend ring -n N -- python -m
tests.distributed_rank --model-dir DIR --strategy tensor|pipeline --out FILE`, or plain
`python -m tests.distributed_rank --strategy none` for the single-process reference.

It follows the shape the engine worker will have: each step rank 0 decides the commands (new
prompts, removals), broadcasts them, and every rank applies them to its own BatchGenerator and
steps it. Rank 0 writes the generated tokens and timings to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlxd.distributed.broadcast import broadcast_object, is_leader, shared_seed
from mlxd.distributed.shard import load_rank
from mlxd.distributed.timing import communication_ms
from mlxd.models.loader import load_llm

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime, briefly please.",
    "Hi",
)
# step -> commands: prompts 0-2 start together (left-padded prefill), 3 joins mid-decode,
# 1 is removed mid-decode (an abort). The schedule is fixed so every run is comparable.
SCHEDULE: dict[int, dict[str, list[int]]] = {
    0: {"insert": [0, 1, 2]},
    5: {"insert": [3]},
    12: {"remove": [1]},
}


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run(args: argparse.Namespace) -> dict[str, Any]:
    group = mx.distributed.init()
    started = time.perf_counter()
    if args.strategy == "none":
        loaded = load_llm(Path(args.model_dir), model_name="smol")
    else:
        loaded = load_rank(
            Path(args.model_dir), strategy=args.strategy, model_name="smol", group=group
        )
    load_s = time.perf_counter() - started
    if args.verbose:
        print(f"rank {group.rank()} loaded in {load_s:.1f}s", file=sys.stderr, flush=True)
    leader = is_leader(group)
    generator = BatchGenerator(
        loaded.model,
        max_tokens=args.max_tokens,
        stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids],
        prefill_batch_size=4,
        completion_batch_size=8,
    )
    # Unused at temperature 0, but the worker must do it: samplers draw from the global RNG.
    mx.random.seed(shared_seed(group, stream=generator.stream))
    uid_of: dict[int, int | None] = {}  # prompt index -> BatchGenerator uid while running
    tokens: dict[int, list[int]] = {}
    broadcast_s: list[float] = []
    step_s: list[float] = []
    step = 0
    while step <= max(SCHEDULE) or any(uid is not None for uid in uid_of.values()):
        tick = time.perf_counter()
        commands = broadcast_object(
            {
                "insert": [
                    (i, prompt_ids(loaded.tokenizer, PROMPTS[i]))
                    for i in SCHEDULE.get(step, {}).get("insert", [])
                ],
                "remove": SCHEDULE.get(step, {}).get("remove", []),
            }
            if leader
            else None,
            group,
            stream=generator.stream,
        )
        broadcast_s.append(time.perf_counter() - tick)
        if commands["insert"]:
            uids = generator.insert([ids for _, ids in commands["insert"]])
            for (index, _), uid in zip(commands["insert"], uids, strict=True):
                uid_of[index] = uid
                tokens[index] = []
        removing = [uid_of[i] for i in commands["remove"] if uid_of.get(i) is not None]
        if removing:
            generator.remove(removing)
            for index in commands["remove"]:
                uid_of[index] = None
        tick = time.perf_counter()
        _, generated = generator.next()
        step_s.append(time.perf_counter() - tick)
        index_of = {uid: index for index, uid in uid_of.items() if uid is not None}
        for response in generated:
            tokens[index_of[response.uid]].append(response.token)
            if response.finish_reason is not None:
                uid_of[index_of[response.uid]] = None
        if args.verbose:
            print(
                f"rank {group.rank()} step {step} took {step_s[-1]:.3f}s",
                file=sys.stderr,
                flush=True,
            )
        step += 1
        if step > 500:
            raise RuntimeError("generation did not finish")
    # The generator has already started one more step, whose collectives need every rank: a
    # rank that exited now would fail the others mid-step. A last broadcast on the same stream
    # waits for that step everywhere (the worker's "stop" command does the same).
    broadcast_object("stop" if leader else None, group, stream=generator.stream)
    return {
        "rank": group.rank(),
        "size": group.size(),
        "tokens": {str(k): v for k, v in sorted(tokens.items())},
        "text": {str(k): loaded.tokenizer.decode(v) for k, v in sorted(tokens.items())},
        "load_s": load_s,
        "steps": step,
        "step_ms": [round(s * 1000, 3) for s in step_s],
        "broadcast_ms": [round(s * 1000, 3) for s in broadcast_s],
        "comm_ms": communication_ms(loaded.config, args.strategy, group, batch=3)
        if args.time_comm
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--strategy", choices=("none", "tensor", "pipeline"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument(
        "--time-comm", action="store_true", help="also time one decode step's collectives alone"
    )
    args = parser.parse_args()
    result = run(args)
    # Every rank reports, so a test can check they all generated the same tokens.
    out = Path(args.out)
    if result["rank"] != 0:
        out = out.with_suffix(f".rank{result['rank']}.json")
    out.write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
