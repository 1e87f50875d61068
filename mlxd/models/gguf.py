"""Import a llama-family GGUF file as an MLX-lm model directory.

`mx.load` reads GGUF natively and hands Q4_0/Q4_1/Q8_0 tensors over already in MLX's affine
quantized layout (uint32-packed weight + scales + biases, group size 32). So importing is renaming
tensors, describing the model in config.json and rebuilding the tokenizer from the metadata.
(transformers' own GGUF import needs torch, which mlxd does not install.)
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

log = logging.getLogger(__name__)

# Every GGUF quantization type that mx.load understands uses blocks of 32 values.
GGUF_GROUP_SIZE = 32
SUPPORTED_ARCHITECTURES = frozenset({"llama"})
# Metadata without a sensible default ("{arch}" is general.architecture).
_REQUIRED_METADATA = (
    "{arch}.embedding_length",
    "{arch}.feed_forward_length",
    "{arch}.block_count",
    "{arch}.attention.head_count",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL_TOKEN = 3
_USER_DEFINED_TOKEN = 4

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|scales|biases)")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class GGUFError(ValueError):
    """A GGUF file that is unreadable or describes a model this importer does not support."""


def gguf_tensor_name(name: str) -> str:
    """Map a GGUF tensor name (blk.3.attn_q.weight) to its MLX-lm llama name."""
    if m := _BLOCK_RE.fullmatch(name):
        layer, part, suffix = m.groups()
        if part in _BLOCK_TENSORS:
            return f"model.layers.{layer}.{_BLOCK_TENSORS[part]}.{suffix}"
    elif (m := _GLOBAL_RE.fullmatch(name)) and m[1] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m[1]]}.{m[2]}"
    raise GGUFError(f"unsupported GGUF tensor {name!r}")


def quantized_bits(packed_columns: int, groups: int, group_size: int = GGUF_GROUP_SIZE) -> int:
    """Bits per weight of a row packed in `packed_columns` uint32 words holding `groups` groups."""
    bits, rest = divmod(32 * packed_columns, groups * group_size)
    if rest or bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFError(
            f"cannot infer bits from {packed_columns} packed columns and {groups} groups "
            f"of {group_size}"
        )
    return bits


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """The config.json `quantization` section: the commonest bit width plus per-module overrides.

    GGUF files mix widths (Q4_1 keeps the token embedding at 8 bits), and mlx-lm rejects weights
    whose packed width disagrees with the bits it was told, so every other width is spelled out
    under the module's path.
    """
    bits = {
        name.removesuffix(".scales"): quantized_bits(
            weights[name.replace(".scales", ".weight")].shape[-1], scales.shape[-1]
        )
        for name, scales in weights.items()
        if name.endswith(".scales")
    }
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    config: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, width in sorted(bits.items()):
        if width != default:
            config[module] = {"group_size": GGUF_GROUP_SIZE, "bits": width, "mode": "affine"}
    return config


def _scalar(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key, default)
    if not isinstance(value, mx.array):
        return value
    item = value.item()
    if value.dtype == mx.float32:
        assert isinstance(item, float)  # item() is typed as any scalar
        # The shortest decimal of the float32 (1e-05, not 9.999999747378752e-06) reads better.
        return float(str(np.float32(item)))
    return item


def _token_id(metadata: dict[str, Any], role: str) -> int | None:
    return _scalar(metadata, f"tokenizer.ggml.{role}_token_id")


def model_config(metadata: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """config.json for mlx-lm's llama model (weights already renamed)."""
    arch = metadata["general.architecture"]

    def meta(key: str, default: Any = None) -> Any:
        return _scalar(metadata, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta("rope.freq_base", 10000.0),
        # llama.cpp stores q/k permuted for interleaved ("traditional") RoPE.
        "rope_traditional": True,
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "bos_token_id": _token_id(metadata, "bos"),
        "eos_token_id": _token_id(metadata, "eos"),
    }
    if meta("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": meta("rope.scaling.factor")}
    if quantization := quantization_config(weights):
        config["quantization"] = quantization
    return config


def _pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face equivalent of llama.cpp's `tokenizer.ggml.pre` regex set."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits every digit off before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name == "llama-bpe":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if name not in (None, "default", "gpt-2"):
        log.warning("GGUF pre-tokenizer %r is unknown; using the GPT-2 split", name)
    return byte_level


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the GGUF vocabulary and merges."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]

    tokenizer = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    post: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)]
    bos = _token_id(metadata, "bos")
    if _scalar(metadata, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        post.append(
            processors.TemplateProcessing(
                single=f"{tokens[bos]} $A",
                pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                special_tokens=[(tokens[bos], bos)],
            )
        )
    tokenizer.post_processor = processors.Sequence(post)

    def added(kind: int, special: bool) -> list[AddedToken]:
        return [
            AddedToken(tokens[i], special=special, normalized=False)
            for i, t in enumerate(types)
            if t == kind
        ]

    tokenizer.add_special_tokens(added(_CONTROL_TOKEN, special=True))
    tokenizer.add_tokens(added(_USER_DEFINED_TOKEN, special=False))
    return tokenizer


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special token strings and the chat template."""
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": _scalar(
            metadata, f"{metadata['general.architecture']}.context_length", 2048
        ),
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token := _token_id(metadata, key)) is not None:
            config[f"{role}_token"] = tokens[token]
    if template := metadata.get("tokenizer.chat_template"):
        config["chat_template"] = template
    return config


def generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: mlx-lm reads its eos ids as the stop tokens."""
    eos = [
        token
        for token in (_token_id(metadata, "eos"), _token_id(metadata, "eot"))
        if token is not None
    ]
    config = {
        "bos_token_id": _token_id(metadata, "bos"),
        "eos_token_id": list(dict.fromkeys(eos)),
        "pad_token_id": _token_id(metadata, "padding"),
    }
    return {key: value for key, value in config.items() if value not in (None, [])}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files for `gguf_path` into `out_dir`.

    Raises GGUFError for unreadable files and unsupported models.
    """
    with tqdm(total=3, desc=f"converting {gguf_path.name}", unit="step", disable=None) as bar:
        try:
            loaded = mx.load(str(gguf_path), return_metadata=True)
        except (RuntimeError, ValueError) as exc:
            raise GGUFError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
        # mx.load's return type covers every format; with metadata it is (arrays, metadata).
        assert isinstance(loaded, tuple)
        raw, metadata = loaded
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"GGUF architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        required = (key.format(arch=arch) for key in _REQUIRED_METADATA)
        if missing := [key for key in required if key not in metadata]:
            raise GGUFError(f"GGUF file {gguf_path} lacks metadata {', '.join(missing)}")
        weights = {gguf_tensor_name(name): array for name, array in raw.items()}
        _write_json(out_dir / "config.json", model_config(metadata, weights))
        bar.update()

        build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
        _write_json(out_dir / "tokenizer_config.json", tokenizer_config(metadata))
        _write_json(out_dir / "generation_config.json", generation_config(metadata))
        bar.update()

        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        bar.update()
