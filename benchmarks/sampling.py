"""Per-step cost of sampling at temperature 0.7 / top_p 0.9: mlx-lm's full sort against mlxd's
batched draw (mlxd/executor/nucleus.py: on the CPU its kernel), and whole SmolLM2 decode steps.

python -m benchmarks.sampling [--batches 1,8,32] [--vocabs 49152,128256] [--steps]

Sampling table: one step's sampling of `batch` rows of logits (ms, fastest round), each from
the logits as a decode step has them: "greedy" their argmax; "mlx-lm" `logsumexp` then
`make_sampler(temp, top_p)`; "mlxd" `sample_rows` with a sampler per row (the way the engine
samples), its tokens as the engine reads them; "seeded" the same with a seed per row; "t only":
temperature alone (top_p 1), mlx-lm's `logsumexp` + `make_sampler(temp)` against mlxd's.
"peaked": logits drawn as N(0, 5²), whose nucleus is tens to hundreds of tokens, as a trained
model's is; "flat": a uniform distribution (a random model's), whose nucleus is most of the
vocabulary (a tree from before the CPU kernel drew such rows twice, the second time from a full
sort).

--steps: whole decode steps of SmolLM2 (the engine's load path and executor, story prompts,
median ms over interleaved turns) with every row greedy, sampled, or sampled with its own seed.
Run it with another tree first on PYTHONPATH to measure that tree's executor side by side.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.compare import machine  # noqa: E402
from benchmarks.profile_step import best_ms  # noqa: E402
from mlxd.accel import ensure_optimized_blas  # noqa: E402
from mlxd.cli.loadgen import parse_levels, story_prompts  # noqa: E402

TEMPERATURE, TOP_P = 0.7, 0.9
STEP_KINDS = ("greedy", "sampled", "seeded", "t only")


def samplers(kind: str, batch: int, vocab: int) -> list[Any]:
    from mlxd.executor.sampling import make_sequence_sampler
    from mlxd.types import SamplingParams

    if kind == "greedy":
        return [make_sequence_sampler(SamplingParams(temperature=0), vocab)] * batch
    if kind == "t only":
        return [make_sequence_sampler(SamplingParams(temperature=TEMPERATURE), vocab)] * batch
    return [
        make_sequence_sampler(
            SamplingParams(
                temperature=TEMPERATURE, top_p=TOP_P, seed=row if kind == "seeded" else None
            ),
            vocab,
        )
        for row in range(batch)
    ]


def settled_tokens(logits, rows: list[Any]):
    """The step's tokens as the engine reads them: a tree from before the CPU kernel settled
    them (its rows whose nucleus passed the candidates drawn again), a tree from before that
    or after it returns them exact, with no third field."""
    from mlxd.executor.sampling import sample_rows

    draw = sample_rows(logits, rows)
    unsettled = getattr(draw, "unsettled", None)
    if unsettled is None:
        return draw[0]
    from mlxd.executor.nucleus import settle

    return settle(draw[0], unsettled)


def sampling_table(batches: list[int], vocabs: list[int]) -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxd import kernels

    kernels.share_cores(packed=True)  # the kernels' threads, as a packed model's load sets them
    full_sort = make_sampler(temp=TEMPERATURE, top_p=TOP_P)
    tempered = make_sampler(temp=TEMPERATURE)

    def mlx_lm(logits, sampler=full_sort):
        return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    print(f"\nsampling of one step, temperature {TEMPERATURE}, top_p {TOP_P}; ms per step")
    print(
        f"{'vocab':>7} {'batch':>5} {'logits':>6} | {'greedy':>6} | {'mlx-lm':>7} | "
        f"{'mlxd':>6} | {'seeded':>6} | {'mlx-lm/mlxd':>11} | {'t only: mlx-lm':>14} | "
        f"{'mlxd':>6}"
    )
    for vocab in vocabs:
        for batch in batches:
            for shape in ("peaked", "flat"):
                scale = 5.0 if shape == "peaked" else 0.0
                logits = mx.random.normal((batch, vocab)) * scale
                mx.eval(logits)
                greedy = best_ms(functools.partial(mx.argmax, logits, axis=-1), 3, 5)
                theirs = best_ms(functools.partial(mlx_lm, logits), repeat=3, rounds=5)
                ours, seeded, ours_t = (
                    best_ms(
                        functools.partial(settled_tokens, logits, samplers(kind, batch, vocab)),
                        repeat=3,
                        rounds=5,
                    )
                    for kind in ("sampled", "seeded", "t only")
                )
                theirs_t = best_ms(functools.partial(mlx_lm, logits, tempered), 3, 5)
                print(
                    f"{vocab:>7} {batch:>5} {shape:>6} | {greedy:>6.2f} | {theirs:>7.2f} | "
                    f"{ours:>6.2f} | {seeded:>6.2f} | {theirs / ours:>10.1f}x | "
                    f"{theirs_t:>14.2f} | {ours_t:>6.2f}",
                    flush=True,
                )


def step_table(batches: list[int], rounds: int) -> None:
    from benchmarks.compare import resolve_model_dir
    from mlxd.executor.batch import BatchExecutor, NewRow
    from mlxd.models.loader import load_llm
    from mlxd.scheduler import Chunk

    model_dir = resolve_model_dir(None, Path("~/.cache/mlxd").expanduser())
    loaded = load_llm(model_dir, model_name="smol")
    tokenizer, vocab = loaded.tokenizer, loaded.model.args.vocab_size
    prompts = story_prompts()

    def decoding(kind: str, batch: int):
        texts = [[{"role": "user", "content": next(prompts)}] for _ in range(batch)]
        ids = [tokenizer.apply_chat_template(t, add_generation_prompt=True) for t in texts]
        executor = BatchExecutor(loaded.model, stop_tokens=[])
        rows = samplers(kind, batch, vocab)
        executor.add([NewRow(uid, ids[uid], 10**6, sampler=rows[uid]) for uid in range(batch)])
        executor.run([Chunk(uid, 0, len(ids[uid]) - 1) for uid in range(batch)], [])
        uids = list(range(batch))
        for _ in range(3):  # every row past its first tokens
            executor.run([], uids)
        return lambda: executor.run([], uids)

    print(f"\nwhole SmolLM2 decode steps, ms (median over {rounds} interleaved turns of 3)")
    for batch in batches:
        steps = {kind: decoding(kind, batch) for kind in STEP_KINDS}
        times: dict[str, list[float]] = {kind: [] for kind in STEP_KINDS}
        for _ in range(rounds):
            for kind, step in steps.items():
                step()
                for _ in range(3):
                    started = time.perf_counter()
                    step()
                    times[kind].append((time.perf_counter() - started) * 1e3)
        median = {kind: statistics.median(t) for kind, t in times.items()}
        print(
            f"batch {batch:>2}: "
            + ", ".join(
                f"{kind} {ms:.1f} ({median['greedy'] / ms:.2f}x)" for kind, ms in median.items()
            )
            + f"; load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=parse_levels, default=[1, 8, 32])
    parser.add_argument("--vocabs", type=parse_levels, default=[49_152, 128_256])
    parser.add_argument("--steps", action="store_true", help="whole decode steps of SmolLM2 only")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.steps:
        ensure_optimized_blas("benchmarks.sampling")
    print(f"{machine()}; load average {os.getloadavg()[0]:.1f}")
    if args.steps:
        step_table(args.batches, args.rounds)
    else:
        sampling_table(args.batches, args.vocabs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
