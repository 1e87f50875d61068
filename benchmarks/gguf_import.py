"""GGUF import (models/gguf.py) on a random-weight file shaped like a real model.

python -m benchmarks.gguf_import [--shape llama-3.2-1b|llama-3.1-8b] [--keep DIR]

Writes a GGUF as `llama-quantize ... Q4_K_M` lays one out (Q4_K matrices; Q6_K for the token
embedding and half of attn_v / ffn_down; llama3 `rope_freqs`; a 128k byte-level BPE vocabulary),
then times the header inspection (`mlxd check`) and the conversion in a child process and prints
its peak RSS. The weights are random blocks, so only time and memory mean anything. The machine
is shared: compare runs made together.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

# hidden, layers, heads, kv heads, ffn, vocab
SHAPES = {
    "llama-3.2-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256),
}


def add_llama3_metadata(writer: Any, shape: tuple[int, ...]) -> Any:
    """A Llama 3's hyperparameters and 128k byte-level BPE vocabulary on a `gguf.GGUFWriter`;
    returns its llama3 `rope_freqs` tensor, which llama.cpp's converter writes first."""
    from tokenizers import pre_tokenizers

    from tests.tiny_gguf import llama3_rope_freqs

    hidden, layers, heads, kv, ffn, vocab = shape
    head_dim = hidden // heads
    writer.add_context_length(131072)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["t 0"])
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = llama3_rope_freqs(
        {"rope_theta": 500000.0, "head_dim": head_dim, "rope_scaling": scaling}
    )
    return rope


def write_q4_k_m(path: Path, shape: tuple[int, ...]) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from tests.tiny_gguf import random_blocks

    hidden, layers, heads, kv, ffn, vocab = shape
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("rope_freqs.weight", add_llama3_metadata(writer, shape))
    writer.add_tensor("token_embd.weight", random_blocks(Q.Q6_K, vocab, hidden), raw_dtype=Q.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        six = Q.Q6_K if i % 2 else Q.Q4_K
        matrices = {
            "attn_q": (hidden, hidden, Q.Q4_K),
            "attn_k": (kv * head_dim, hidden, Q.Q4_K),
            "attn_v": (kv * head_dim, hidden, six),
            "attn_output": (hidden, hidden, Q.Q4_K),
            "ffn_gate": (ffn, hidden, Q.Q4_K),
            "ffn_up": (ffn, hidden, Q.Q4_K),
            "ffn_down": (hidden, ffn, six),
        }
        for name, (rows, cols, qtype) in matrices.items():
            blocks = random_blocks(qtype, rows, cols, seed=i)
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def child(gguf_path: str, out: str) -> None:
    from mlxd.models.gguf import convert_gguf, inspect_gguf

    started = time.perf_counter()
    problems = inspect_gguf(Path(gguf_path))
    inspected = time.perf_counter()
    convert_gguf(Path(gguf_path), Path(out))
    done = time.perf_counter()
    print(f"inspect_gguf: {inspected - started:.2f} s, problems: {problems}")
    print(f"convert_gguf: {done - inspected:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.2-1b")
    parser.add_argument("--keep", type=Path, help="write the GGUF and the output here")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="gguf-import-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gguf_path, out = workdir / f"{args.shape}.Q4_K_M.gguf", workdir / "converted"
    if not gguf_path.exists():
        write_q4_k_m(gguf_path, SHAPES[args.shape])
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.gguf_import", "--child", str(gguf_path), str(out)]
    subprocess.run(command, check=True, cwd=REPO_ROOT)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    written = sum(f.stat().st_size for f in out.iterdir()) / 2**30
    print(f"file {gguf_path.stat().st_size / 2**30:.2f} GiB → {written:.2f} GiB converted")
    print(f"peak RSS of the conversion: {peak:.2f} GiB (mapped file pages included)")


if __name__ == "__main__":
    main()
