"""Random-weight Llama 3 models shaped like real ones, as the files people download: an F16
GGUF for llama.cpp's own `llama-quantize` to make the Q4_K_M everybody runs, and an MLX 4-bit
directory as mlx-community publishes them (group 64). Both are written tensor by tensor, so an
8B shape never has its weights in memory at once. The weights are random: only load time,
memory and speed mean anything.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np

from benchmarks.gguf_import import SHAPES, add_llama3_metadata

# Llama-3.2-1B ties its output head to the embedding; Llama-3.1-8B has its own.
TIED = {"llama-3.2-1b": True, "llama-3.1-8b": False}
STD = 0.02  # the weights' standard deviation (Llama's initializer range)
MLX_GROUP_SIZE, MLX_BITS = 64, 4  # mlx-community's "4bit" recipe
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Per layer: GGUF name, mlx-lm name, (rows, cols) from (hidden, kv_dim, ffn); None: a norm.
_LAYER = (
    ("attn_norm", "input_layernorm", None),
    ("attn_q", "self_attn.q_proj", ("hidden", "hidden")),
    ("attn_k", "self_attn.k_proj", ("kv", "hidden")),
    ("attn_v", "self_attn.v_proj", ("kv", "hidden")),
    ("attn_output", "self_attn.o_proj", ("hidden", "hidden")),
    ("ffn_norm", "post_attention_layernorm", None),
    ("ffn_gate", "mlp.gate_proj", ("ffn", "hidden")),
    ("ffn_up", "mlp.up_proj", ("ffn", "hidden")),
    ("ffn_down", "mlp.down_proj", ("hidden", "ffn")),
)


def tensors(name: str) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, mlx-lm name, shape) of every weight of shape `name`, in file order;
    a 1-D shape is a norm."""
    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[name]
    sizes = {"hidden": hidden, "kv": kv_heads * (hidden // heads), "ffn": ffn}
    yield "token_embd.weight", "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        for gguf_name, mlx_name, dims in _LAYER:
            shape = (hidden,) if dims is None else (sizes[dims[0]], sizes[dims[1]])
            yield f"blk.{i}.{gguf_name}.weight", f"model.layers.{i}.{mlx_name}.weight", shape
    yield "output_norm.weight", "model.norm.weight", (hidden,)
    if not TIED[name]:
        yield "output.weight", "lm_head.weight", (vocab, hidden)


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
    if len(shape) == 1:
        return np.ones(shape, np.float32)  # norms: llama.cpp keeps them float32
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, np.float32) * STD).astype(np.float16)


def _llama_writer(path: Path, name: str) -> tuple[gguf.GGUFWriter, np.ndarray]:
    """A GGUF writer holding the metadata (tokenizer included) of shape `name`, and the
    RoPE frequencies that go with it."""
    vocab = SHAPES[name][-1]
    writer = gguf.GGUFWriter(path, "llama")
    rope = add_llama3_metadata(writer, SHAPES[name])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_chat_template(CHATML)  # both servers format chats the same way
    return writer, rope


def write_vocab_gguf(path: Path, name: str) -> None:
    """The metadata of shape `name`'s GGUF and no tensors: the tokenizer for
    `write_mlx_4bit` where no llama.cpp peer needs the weights."""
    writer, _ = _llama_writer(path, name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def write_f16_gguf(path: Path, name: str) -> None:
    """The F16 GGUF llama.cpp's converter would write for a model of shape `name`."""
    writer, rope = _llama_writer(path, name)
    writer.add_tensor_info("rope_freqs.weight", rope.shape, rope.dtype, rope.nbytes)
    specs = list(tensors(name))
    for gguf_name, _, shape in specs:
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        writer.add_tensor_info(gguf_name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_tensor_data(rope)
    for seed, (_, _, shape) in enumerate(specs):
        writer.write_tensor_data(_random(shape, seed))
    writer.close()


def quantize(quantizer: Path, f16: Path, out: Path, threads: int, kind: str = "Q4_K_M") -> None:
    """`llama-quantize f16 out Q4_K_M` (or another `kind`), as a user would make (or download)
    one."""
    partial = out.with_suffix(".partial")
    command = [str(quantizer), str(f16), str(partial), kind, str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    partial.replace(out)


def write_mlx_4bit(directory: Path, name: str, tokenizer_gguf: Path) -> None:
    """An mlx-lm directory of shape `name`, 4-bit at group 64 (norms float16), with the
    tokenizer of `tokenizer_gguf` (so both servers tokenize alike)."""
    import mlx.core as mx

    from mlxd.models.gguf import gguf_metadata
    from mlxd.models.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config

    hidden, layers, heads, kv_heads, ffn, vocab = SHAPES[name]
    directory.mkdir(parents=True, exist_ok=True)
    shard: dict[str, mx.array] = {}
    shards = 0
    for seed, (_, mlx_name, shape) in enumerate(tensors(name)):
        weight = mx.array(_random(shape, seed)).astype(mx.float16)
        if len(shape) == 1:
            shard[mlx_name] = weight
            continue
        base = mlx_name.removesuffix(".weight")
        quantized, scales, biases = mx.quantize(weight, MLX_GROUP_SIZE, MLX_BITS)
        shard |= {mlx_name: quantized, f"{base}.scales": scales, f"{base}.biases": biases}
        if sum(a.nbytes for a in shard.values()) > 1 << 30:
            mx.save_safetensors(str(directory / f"model-{shards:05d}.safetensors"), shard)
            shard, shards = {}, shards + 1
    mx.save_safetensors(str(directory / f"model-{shards:05d}.safetensors"), shard)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": ffn,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": TIED[name],
        "torch_dtype": "float16",
        "quantization": {"group_size": MLX_GROUP_SIZE, "bits": MLX_BITS},
    }
    metadata = gguf_metadata(tokenizer_gguf)
    build_tokenizer(metadata).save(str(directory / "tokenizer.json"))
    files = {
        "config.json": config,
        "tokenizer_config.json": tokenizer_config(metadata, 131072),
        "generation_config.json": generation_config(metadata),
    }
    for filename, content in files.items():
        (directory / filename).write_text(json.dumps(content, indent=1))
