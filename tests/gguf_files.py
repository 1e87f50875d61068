"""Tiny GGUF files written by llama.cpp's own `gguf` package, for header checks: any
architecture, tokenizer and tensor type (a quantized tensor's blocks are random bytes; only
the header is meant to be read)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

HIDDEN = 64
VOCAB = 32


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer: str = "gpt2",
    matrix_type: str = "F32",
    layers: int = 1,
    context: int = 2048,
) -> Path:
    """A GGUF shaped like a one-layer llama with `arch`'s metadata keys; its matrices stored as
    `matrix_type` (a GGML type name), its norms as F32."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(2 * HIDDEN)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges(["t 1"])
    rng = np.random.default_rng(0)
    writer.add_tensor(
        "token_embd.weight", _matrix(rng, VOCAB, HIDDEN, matrix_type), **_raw(matrix_type)
    )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(layers):
        for name in ("attn_q", "attn_output"):
            tensor = _matrix(rng, HIDDEN, HIDDEN, matrix_type)
            writer.add_tensor(f"blk.{layer}.{name}.weight", tensor, **_raw(matrix_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _matrix(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    if kind == "F32":
        return rng.standard_normal((rows, cols), dtype=np.float32)
    if kind == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


def _raw(kind: str) -> dict:
    return {} if kind in ("F32", "F16") else {"raw_dtype": GGMLQuantizationType[kind]}
