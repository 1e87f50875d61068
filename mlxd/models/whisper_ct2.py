"""A CTranslate2 Whisper model (faster-whisper's format) as an mlx-audio Whisper directory.

CTranslate2 fuses what Whisper keeps apart: a self-attention's query, key and value in one
`linear_0` (the key's bias, which Whisper lacks, is stored as zeros), a cross-attention's key
and value in one `linear_1`. They are split back and renamed to mlx-audio's Whisper names
(mlx_audio.stt.models.whisper: blocks.N.attn.query …); Conv1d kernels go from (out, in, k) to
MLX's (out, k, in). The tokenizer.json faster-whisper ships lacks the timestamp tokens that
vocabulary.txt lists (<|0.00|> … <|30.00|>); they are added, or Whisper's timestamp rules and
mlx-audio's decoding (which looks them up by name) break.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxd.models.ctranslate2 import CTranslate2Error, read_model, spec_name

WHISPER_SPEC = "WhisperSpec"
# Bumped when the import's output changes: the cache then imports again.
FORMAT_VERSION = 1
_LAYER = re.compile(r"^(encoder|decoder)/layer_(\d+)/")
# Whisper's audio front end (the same for every size but large-v3's 128 mels).
SAMPLE_RATE, CHUNK_SECONDS = 16000, 30
_FEATURES = {
    "sampling_rate": SAMPLE_RATE,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": CHUNK_SECONDS,
}


def is_ct2_whisper(model_dir: Path) -> bool:
    """True for a directory holding a CTranslate2 Whisper model.bin."""
    return spec_name(model_dir / "model.bin") == WHISPER_SPEC


def convert_ct2_whisper(source: Path, target: Path) -> None:
    """Write `target` (an existing empty directory) as an mlx-audio Whisper model."""
    model = read_model(source / "model.bin")
    if model.spec != WHISPER_SPEC:
        raise CTranslate2Error(f"{source}: a {model.spec}, not a Whisper model")
    v = model.variables
    weights: dict[str, np.ndarray] = {}

    def linear(name: str, key: str) -> None:
        weights[f"{name}.weight"] = v[f"{key}/weight"]
        weights[f"{name}.bias"] = v[f"{key}/bias"]

    def fused(names: list[str], key: str) -> None:
        for name, w, b in zip(
            names,
            np.split(v[f"{key}/weight"], len(names)),
            np.split(v[f"{key}/bias"], len(names)),
            strict=True,
        ):
            weights[f"{name}.weight"] = w
            if not name.endswith(".key"):  # Whisper's key projections have no bias
                weights[f"{name}.bias"] = b

    def norm(name: str, key: str) -> None:
        weights[f"{name}.weight"] = v[f"{key}/gamma"]
        weights[f"{name}.bias"] = v[f"{key}/beta"]

    layers = {side: 0 for side in ("encoder", "decoder")}
    for key in v:
        if match := _LAYER.match(key):
            layers[match[1]] = max(layers[match[1]], int(match[2]) + 1)
    for side, count in layers.items():
        for i in range(count):
            src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
            qkv = [f"{dst}.attn.{p}" for p in ("query", "key", "value")]
            fused(qkv, f"{src}/self_attention/linear_0")
            linear(f"{dst}.attn.out", f"{src}/self_attention/linear_1")
            norm(f"{dst}.attn_ln", f"{src}/self_attention/layer_norm")
            linear(f"{dst}.mlp1", f"{src}/ffn/linear_0")
            linear(f"{dst}.mlp2", f"{src}/ffn/linear_1")
            norm(f"{dst}.mlp_ln", f"{src}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{dst}.cross_attn.query", f"{src}/attention/linear_0")
                kv = [f"{dst}.cross_attn.key", f"{dst}.cross_attn.value"]
                fused(kv, f"{src}/attention/linear_1")
                linear(f"{dst}.cross_attn.out", f"{src}/attention/linear_2")
                norm(f"{dst}.cross_attn_ln", f"{src}/attention/layer_norm")
    for conv in ("conv1", "conv2"):
        weights[f"encoder.{conv}.weight"] = v[f"encoder/{conv}/weight"].transpose(0, 2, 1)
        weights[f"encoder.{conv}.bias"] = v[f"encoder/{conv}/bias"]
    norm("encoder.ln_post", "encoder/layer_norm")
    norm("decoder.ln", "decoder/layer_norm")
    weights["decoder.token_embedding.weight"] = v["decoder/embeddings/weight"]
    # The encoder's sinusoids mlx-audio computes itself; the decoder's positions are learned.
    weights["decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
    mx.save_safetensors(
        str(target / "model.safetensors"),
        {name: mx.array(np.ascontiguousarray(w)) for name, w in weights.items()},
    )

    vocab, state = v["decoder/embeddings/weight"].shape
    dims: dict[str, int | str] = {
        "model_type": "whisper",
        "n_mels": int(v["encoder/conv1/weight"].shape[1]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(v["encoder/conv1/weight"].shape[0]),
        "n_audio_head": model.scalar("encoder/num_heads"),
        "n_audio_layer": layers["encoder"],
        "n_vocab": int(vocab),
        "n_text_ctx": int(v["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(state),
        "n_text_head": model.scalar("decoder/num_heads"),
        "n_text_layer": layers["decoder"],
    }
    _write_json(target / "config.json", dims)
    settings = json.loads((source / "config.json").read_text())
    if "alignment_heads" in settings:  # the heads word timestamps follow
        heads = {"alignment_heads": settings["alignment_heads"]}
        _write_json(target / "generation_config.json", heads)
    _write_json(
        target / "preprocessor_config.json",
        {
            **_FEATURES,
            "feature_extractor_type": "WhisperFeatureExtractor",
            "processor_class": "WhisperProcessor",
            "feature_size": dims["n_mels"],
            "n_samples": SAMPLE_RATE * CHUNK_SECONDS,
            "nb_max_frames": int(dims["n_audio_ctx"]) * 2,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": False,
        },
    )
    _write_json(
        target / "tokenizer_config.json",
        {
            "tokenizer_class": "WhisperTokenizer",
            "processor_class": "WhisperProcessor",
            "model_max_length": dims["n_text_ctx"],
            **{f"{role}_token": "<|endoftext|>" for role in ("bos", "eos", "unk", "pad")},
        },
    )
    _write_json(target / "tokenizer.json", _complete_tokenizer(source))


def _complete_tokenizer(source: Path) -> dict:
    """faster-whisper's tokenizer.json with every vocabulary.txt entry it lacks added as a
    special token at its vocabulary index."""
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    known = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    vocabulary = (source / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    for index, token in enumerate(vocabulary):
        if index not in known and token:
            tokenizer["added_tokens"].append(
                {
                    "id": index,
                    "content": token,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            )
    return tokenizer


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False), encoding="utf-8")
