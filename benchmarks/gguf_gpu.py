"""Every GGUF type mlxd converts, run on MLX's GPU backend against its CPU backend.

python -m benchmarks.gguf_gpu prepare --out DIR    # here: needs llama-quantize and mlxd
python benchmarks/gguf_gpu.py check DIR             # on the GPU machine: needs mlx and mlx-lm

`prepare` writes a tiny random-weight Llama (hidden 256, 3 layers: rows a K-quant's 256-value
super-blocks divide) as an F32 GGUF, has llama.cpp's `llama-quantize` make each common type from
it (K-quant mixes included, so a file holds the types llama.cpp mixes), and converts each with
mlxd's GGUF import into the directory a GPU backend loads (models/gguf.py: MLX's affine layout,
4/5/6/8-bit groups of 32, float16 or float32 scales). `check` loads each directory as mlxd does
on a GPU (the weights as stored) and runs it on the GPU and on the CPU: a 24-token prompt's
logits, then 16 greedy steps through mlx-lm's KV cache, at batch 1 and 4. It prints the largest
logit difference (relative to the largest CPU logit) and how many greedy tokens agree, and
fails if a type does not run on the GPU. `check` imports nothing of mlxd, so a GPU machine needs
only MLX's CUDA (or Metal) build and mlx-lm beside the directories (a few MB each).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# The types people download, most common first (Q4_K_M, Q5_K_M: Q4_K / Q5_K with Q6_K rows).
TYPES = ("Q4_K_M", "Q5_K_M", "Q4_0", "Q8_0", "Q6_K", "Q4_1", "Q5_0", "IQ4_NL", "Q3_K_M")
PROMPT, STEPS, SEED = 24, 16, 0


def prepare(out: Path, quantizer: Path) -> None:
    """The F32 GGUF, each of TYPES from it, and each converted under `out`/<type>."""
    sys.path.insert(0, str(REPO_ROOT))
    from mlxd.models.gguf import convert_gguf
    from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf

    shutil.rmtree(out, ignore_errors=True)
    files = out / "gguf"
    files.mkdir(parents=True)
    config = tiny_config(
        "llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    )
    f32 = files / "F32.gguf"
    write_gguf(f32, config, tiny_weights(config, seed=1))
    for kind in TYPES:
        gguf = files / f"{kind}.gguf"
        command = [str(quantizer), str(f32), str(gguf), kind, "2"]
        subprocess.run(command, capture_output=True, check=True)
        converted = out / kind
        converted.mkdir()
        convert_gguf(gguf, converted)
        quantization = json.loads((converted / "config.json").read_text())["quantization"]
        widths = sorted({v["bits"] for v in quantization.values() if isinstance(v, dict)})
        print(f"{kind}: {quantization['bits']}-bit, other layers {widths}", flush=True)
    shutil.rmtree(files)


def check(root: Path) -> int:
    """Each converted type on the GPU against the CPU; 1 if one failed on the GPU."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    if not mx.is_available(mx.gpu):
        print("MLX has no GPU backend here")
        return 1
    print(f"mlx {mx.__version__}; {mx.device_info().get('device_name', 'GPU')}")
    vocab = json.loads((root / TYPES[0] / "config.json").read_text())["vocab_size"]
    prompts = np.random.default_rng(SEED).integers(0, vocab, size=(4, PROMPT))

    def run(path: Path, device: mx.Device, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prompt's last logits, the greedy tokens, each step's logits."""
        with mx.stream(device):
            model, _ = load_model(path)
            cache = make_prompt_cache(model)
            logits = model(mx.array(prompts[:rows]), cache=cache)[:, -1].astype(mx.float32)
            first, tokens, steps = np.array(logits), [], []
            for _ in range(STEPS):
                token = mx.argmax(logits, axis=-1)
                tokens.append(np.array(token))
                logits = model(token[:, None], cache=cache)[:, -1].astype(mx.float32)
                steps.append(np.array(logits))
            return first, np.stack(tokens, 1), np.stack(steps, 1)

    failed = 0
    for kind in TYPES:
        for rows in (1, 4):
            started = time.perf_counter()
            try:
                gpu = run(root / kind, mx.gpu, rows)
            except Exception as exc:  # a type the backend cannot run: say which, go on
                failed += 1
                print(f"{kind:7} rows {rows}: GPU failed: {type(exc).__name__}: {exc}")
                continue
            seconds = time.perf_counter() - started  # its first run compiles its kernels
            cpu = run(root / kind, mx.cpu, rows)
            scale = np.abs(cpu[0]).max()
            agree = (gpu[1] == cpu[1]).all(axis=0)
            same = STEPS if agree.all() else int(np.argmin(agree))  # steps before one differs
            step_error = np.abs(gpu[2][:, :same] - cpu[2][:, :same]).max() / scale if same else 0
            print(
                f"{kind:7} rows {rows}: prompt logits |gpu - cpu| / max|cpu| "
                f"{np.abs(gpu[0] - cpu[0]).max() / scale:.1e}, greedy tokens alike "
                f"{same}/{STEPS} (their logits {step_error:.1e}), GPU run {seconds:.1f} s",
                flush=True,
            )
    print(f"{failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("prepare", help="write and convert the GGUFs (needs llama-quantize)")
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--llama-server", type=Path, default=None)
    run = sub.add_parser("check", help="run the converted directories on the GPU and the CPU")
    run.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.dir)
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.compare import find_llama_server

    binary = find_llama_server(args.llama_server)
    if binary is None or not (quantizer := binary.parent / "llama-quantize").exists():
        print("no llama-quantize (../shared/tools/build-llama-server builds it)")
        return 1
    prepare(args.out, quantizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
