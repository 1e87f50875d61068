"""Per-step cost of sampling at temperature 0.7 / top_p 0.9: mlx-lm's full sort against mlxd's
partial selection (mlxd/executor/nucleus.py).

python -m benchmarks.sampling [--batches 1,8,32] [--vocabs 49152,128256]

Each row times one step's sampling of `batch` rows of log-probabilities (ms, fastest round).
"peaked": logits drawn as N(0, 5²), whose nucleus is tens to hundreds of tokens, as a trained
model's is; "flat": a uniform distribution (a random model's), whose nucleus reaches beyond the
candidates, so mlxd takes the full-sort fallback and pays for the selection on top.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.compare import cpu_model  # noqa: E402
from benchmarks.profile_step import best_ms  # noqa: E402
from mlxd.cli.loadgen import parse_levels  # noqa: E402

TEMPERATURE, TOP_P = 0.7, 0.9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=parse_levels, default=[1, 8, 32])
    parser.add_argument("--vocabs", type=parse_levels, default=[49_152, 128_256])
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlxd.executor.sampling import make_sequence_sampler
    from mlxd.types import SamplingParams

    full_sort = make_sampler(temp=TEMPERATURE, top_p=TOP_P)
    print(f"CPU: {cpu_model()}; temperature {TEMPERATURE}, top_p {TOP_P}; ms per step")
    print(
        f"{'vocab':>7} {'batch':>5} {'logits':>6} | {'full sort':>9} | {'mlxd':>7} | {'ratio':>6}"
    )
    for vocab in args.vocabs:
        ours = make_sequence_sampler(SamplingParams(temperature=TEMPERATURE, top_p=TOP_P), vocab)
        for batch in args.batches:
            for shape in ("peaked", "flat"):
                scale = 5.0 if shape == "peaked" else 0.0
                logits = mx.random.normal((batch, vocab)) * scale
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                mx.eval(logprobs)
                before = best_ms(functools.partial(full_sort, logprobs), repeat=3, rounds=5)
                after = best_ms(functools.partial(ours, logprobs), repeat=3, rounds=5)
                print(
                    f"{vocab:>7} {batch:>5} {shape:>6} | {before:>9.2f} | {after:>7.2f} | "
                    f"{before / after:>5.1f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
