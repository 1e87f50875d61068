"""mlxd against the stock mlx_lm.server on MLX's GPU backend (CUDA or Metal), on a random-weight
model shaped like a real one.

python -m benchmarks.gpu [--shape llama-3.2-1b|llama-3.1-8b] [--levels 1,8,32] [--max-tokens 128]

Writes (once, under --workdir) an MLX 4-bit directory of the shape (benchmarks/random_llama.py,
the tokenizer from a tensor-less GGUF of the same shape), then runs benchmarks.compare on it with
mlxd and mlx_lm.server as the peers: the same prompts, levels and sampling rows, one server at a
time. On a GPU both keep the weights quantized on MLX's own kernels, so the ratio is what mlxd's
engine (scheduler, batching, sampling, HTTP) adds or costs against mlx-lm's own server on the
same backend. Refuses to run where MLX's default device is the CPU: that is what
benchmarks.compare and benchmarks.real_shapes measure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import compare  # noqa: E402
from benchmarks.gguf_import import SHAPES  # noqa: E402
from benchmarks.random_llama import write_mlx_4bit, write_vocab_gguf  # noqa: E402
from mlxd.accel import backend_name  # noqa: E402


def model_dir(workdir: Path, shape: str) -> Path:
    """The MLX 4-bit directory of `shape` under `workdir`, written unless already there."""
    directory = workdir / f"{shape}.mlx-4bit"
    if not (directory / "config.json").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        vocab = workdir / f"{shape}.vocab.gguf"
        write_vocab_gguf(vocab, shape)
        print(f"writing {directory} …", flush=True)
        write_mlx_4bit(directory, shape, vocab)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--workdir", type=Path, default=Path("~/.cache/mlxd-bench").expanduser())
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sampling", default=",".join(compare.SAMPLING))
    # mlxd sizes its KV cache for max_batch_size sequences of this; the shapes' own 131,072
    # tokens × 32 would not fit (mlx_lm.server grows its cache instead).
    parser.add_argument("--context-length", type=int, default=2048)
    args = parser.parse_args(argv)

    import mlx.core as mx

    backend = backend_name()
    if backend == "cpu":
        print("MLX's default device is the CPU here: no GPU backend to measure", file=sys.stderr)
        return 2
    print(f"backend: {backend}, device: {mx.device_info()}", flush=True)
    directory = model_dir(args.workdir, args.shape)
    return compare.main(
        [
            "--model-dir", str(directory), "--only", "mlxd,baseline",
            "--levels", args.levels, "--max-tokens", str(args.max_tokens),
            "--sampling", args.sampling, "--context-length", str(args.context_length),
        ]
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
