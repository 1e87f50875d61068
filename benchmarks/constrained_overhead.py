"""What one grammar-constrained sequence costs the rest of its decode batch.

Runs B greedy sequences for N tokens in one mlx-lm BatchGenerator (no stop tokens, so the batch
never shrinks) and times the decode steps, for three batches that differ in one sequence only:

- none:     no logits processors at all;
- identity: one sequence with a processor that returns its logits unchanged. This isolates
            mlx-lm's per-row path (once any sequence has a processor, every step splits the
            logits into rows and concatenates them again);
- grammar:  one sequence constrained by a JSON schema through mlxd's GrammarProcessor.

Rounds run the variants in rotated order, so that drift in machine load hits them alike. Per
variant it prints the mean ms/step of its fastest and median round (wall time) and the median
process CPU time per step (all threads, BLAS workers included). Then the processor's own work
per call (context, llguidance mask, unpacking, the masked logits' graph), timed in a separate
run after the forward pass is evaluated. On a machine shared with other work, identical runs
differ by several percent: compare variants only over several rounds.

    python -m benchmarks.constrained_overhead [--model-dir DIR] [--batch-sizes 8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from mlxd.constrain import Constrainer, make_processor
from mlxd.models.loader import LoadedModel, load_llm

SMOLLM2 = Path.home() / ".cache/mlxd/gguf/b179c9523d0e6a0f"
# Long enough that the grammar is still open after the last measured step.
SCHEMA = {
    "type": "object",
    "properties": {
        "animals": {"type": "array", "items": {"type": "string"}, "minItems": 40},
    },
    "required": ["animals"],
}
WARMUP_STEPS = 4

Processor = Callable[[mx.array, mx.array], mx.array]


class Timed:
    """Wraps a processor and adds up the wall time of its own work."""

    def __init__(self, processor: Processor):
        self.processor = processor
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # Waiting for the previous token and this forward pass is every step's cost, not this.
        mx.eval(tokens, logits)
        start = time.perf_counter()
        out = self.processor(tokens, logits)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def run(
    loaded: LoadedModel, prompts: list[list[int]], processor: Processor | None, tokens: int
) -> tuple[float, float]:
    """Wall and process-CPU ms per decode step, the first WARMUP_STEPS after prefill left out."""
    generator = BatchGenerator(loaded.model, stop_tokens=[], completion_batch_size=len(prompts))
    processors = [[processor] if processor and i == 0 else [] for i in range(len(prompts))]
    generator.insert(prompts, max_tokens=[tokens] * len(prompts), logits_processors=processors)
    wall: list[float] = []
    cpu: list[float] = []
    finished = 0
    while finished < len(prompts):
        start, start_cpu = time.perf_counter(), time.process_time()
        responses = generator.next_generated()
        if responses:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        finished += sum(1 for r in responses if r.finish_reason)
    generator.close()
    return 1000 * statistics.fmean(wall[WARMUP_STEPS:]), 1000 * statistics.fmean(cpu[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=SMOLLM2)
    parser.add_argument("--batch-sizes", default="8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    loaded = load_llm(args.model_dir, model_name="bench")
    tokenizer = loaded.tokenizer
    constrainer = Constrainer(tokenizer)
    grammar = constrainer.json_schema(SCHEMA)
    print(f"{args.model_dir}: {args.tokens} tokens, {args.rounds} rounds, {mx.default_device()}")
    print("ms/step: wall min / median, process CPU median; % against 'none'")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"List {40 + i} animals as JSON."}],
                add_generation_prompt=True,
            )
            for i in range(batch)
        ]
        variants: dict[str, Callable[[], Processor | None]] = {
            "none": lambda: None,
            "identity": lambda: lambda _, logits: logits,
            "grammar": lambda: make_processor(constrainer, grammar, tokenizer.eos_token_ids),
        }
        wall: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        run(loaded, prompts, None, 8)  # warm-up
        names = list(variants)
        for round_ in range(args.rounds):
            # Rotated, so that no variant always runs first (or right after another).
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                step_wall, step_cpu = run(loaded, prompts, variants[name](), args.tokens)
                wall[name].append(step_wall)
                cpu[name].append(step_cpu)
        base_wall, base_cpu = min(wall["none"]), statistics.median(cpu["none"])
        for name in variants:
            low, mid, busy = (
                min(wall[name]),
                statistics.median(wall[name]),
                statistics.median(cpu[name]),
            )
            low_pct, busy_pct = 100 * (low / base_wall - 1), 100 * (busy / base_cpu - 1)
            print(
                f"batch {batch:>2} {name:>8}: {low:7.2f} / {mid:7.2f} ({low_pct:+5.1f}%)"
                f"  cpu {busy:7.2f} ({busy_pct:+5.1f}%)"
            )
        timed = Timed(variants["grammar"]())
        run(loaded, prompts, timed, args.tokens)
        own = 1000 * timed.seconds / timed.calls
        print(f"batch {batch:>2} grammar processor's own work: {own:.3f} ms/call")


if __name__ == "__main__":
    main()
