"""The CTranslate2 Whisper import, subtitle rendering and the transcription form."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions
from pydantic import ValidationError

from mlxd.api.openai.audio_protocol import TranscriptionForm
from mlxd.audio.subtitles import srt, timestamp, vtt
from mlxd.models.ctranslate2 import CTranslate2Error, read_model, spec_name
from mlxd.models.speech import load_stt
from mlxd.models.whisper_ct2 import convert_ct2_whisper, is_ct2_whisper
from mlxd.types import Segment

DIMS = ModelDimensions(
    n_mels=8,
    n_audio_ctx=6,
    n_audio_state=16,
    n_audio_head=2,
    n_audio_layer=2,
    n_vocab=40,
    n_text_ctx=5,
    n_text_state=16,
    n_text_head=2,
    n_text_layer=1,
)
_DTYPE_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}


def _string(value: str) -> bytes:
    raw = value.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(path: Path, spec: str, variables: dict[str, np.ndarray], aliases: dict) -> None:
    """A model.bin as ctranslate2's model_spec.py writes it (binary version 6)."""
    out = [struct.pack("<I", 6), _string(spec), struct.pack("<I", 3)]
    out.append(struct.pack("<I", len(variables)))
    for name, value in variables.items():
        out += [_string(name), struct.pack("<B", value.ndim)]
        out += [struct.pack("<I", d) for d in value.shape]
        data = np.ascontiguousarray(value).tobytes()
        out += [struct.pack("<B", _DTYPE_IDS[str(value.dtype)]), struct.pack("<I", len(data)), data]
    out.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        out += [_string(alias), _string(target)]
    path.write_bytes(b"".join(out))


def ct2_variables(model: Model) -> dict[str, np.ndarray]:
    """`model`'s weights under CTranslate2's Whisper names, fused as its converter fuses them
    (written independently of the importer, from ctranslate2's WhisperSpec)."""
    p = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    out: dict[str, np.ndarray] = {}

    def lin(dst: str, src: str) -> None:
        out[f"{dst}/weight"], out[f"{dst}/bias"] = p[f"{src}.weight"], p[f"{src}.bias"]

    def ln(dst: str, src: str) -> None:
        out[f"{dst}/gamma"], out[f"{dst}/beta"] = p[f"{src}.weight"], p[f"{src}.bias"]

    def qkv(dst: str, src: str, parts: tuple[str, ...]) -> None:
        out[f"{dst}/weight"] = np.concatenate([p[f"{src}.{x}.weight"] for x in parts])
        biases = [p.get(f"{src}.{x}.bias", np.zeros(16, np.float32)) for x in parts]
        out[f"{dst}/bias"] = np.concatenate(biases)

    for side, layers in (("encoder", DIMS.n_audio_layer), ("decoder", DIMS.n_text_layer)):
        for i in range(layers):
            s, d = f"{side}.blocks.{i}", f"{side}/layer_{i}"
            qkv(f"{d}/self_attention/linear_0", f"{s}.attn", ("query", "key", "value"))
            lin(f"{d}/self_attention/linear_1", f"{s}.attn.out")
            ln(f"{d}/self_attention/layer_norm", f"{s}.attn_ln")
            lin(f"{d}/ffn/linear_0", f"{s}.mlp1")
            lin(f"{d}/ffn/linear_1", f"{s}.mlp2")
            ln(f"{d}/ffn/layer_norm", f"{s}.mlp_ln")
            if side == "decoder":
                lin(f"{d}/attention/linear_0", f"{s}.cross_attn.query")
                qkv(f"{d}/attention/linear_1", f"{s}.cross_attn", ("key", "value"))
                lin(f"{d}/attention/linear_2", f"{s}.cross_attn.out")
                ln(f"{d}/attention/layer_norm", f"{s}.cross_attn_ln")
        out[f"{side}/num_heads"] = np.array(2, dtype=np.int16)
    for conv in ("conv1", "conv2"):  # CTranslate2 keeps PyTorch's (out, in, kernel)
        out[f"encoder/{conv}/weight"] = p[f"encoder.{conv}.weight"].transpose(0, 2, 1)
        out[f"encoder/{conv}/bias"] = p[f"encoder.{conv}.bias"]
    ln("encoder/layer_norm", "encoder.ln_post")
    ln("decoder/layer_norm", "decoder.ln")
    out["encoder/position_encodings/encodings"] = np.zeros((6, 16), np.float32)
    out["decoder/position_encodings/encodings"] = p["decoder.positional_embedding"]
    out["decoder/embeddings/weight"] = p["decoder.token_embedding.weight"]
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in out.items()}


@pytest.fixture
def ct2_dir(tmp_path: Path) -> tuple[Path, Model]:
    mx.random.seed(0)
    model = Model(DIMS, dtype=mx.float32)
    model.update({"decoder": {"positional_embedding": mx.random.normal((5, 16))}})
    source = tmp_path / "ct2"
    source.mkdir()
    write_ct2(
        source / "model.bin",
        "WhisperSpec",
        ct2_variables(model),
        {"decoder/projection/weight": "decoder/embeddings/weight"},
    )
    (source / "config.json").write_text(json.dumps({"alignment_heads": [[0, 1]]}))
    vocabulary = [f"t{i}" for i in range(36)] + ["<|endoftext|>", "<|notimestamps|>"]
    vocabulary += ["<|0.00|>", "<|0.02|>"]
    (source / "vocabulary.txt").write_text("\n".join(vocabulary))
    tokenizer = {
        "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(36)}, "merges": []},
        "added_tokens": [{"id": 36, "content": "<|endoftext|>", "special": True}],
    }
    (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    return source, model


def test_reads_variables_and_aliases(ct2_dir: tuple[Path, Model]):
    source, _ = ct2_dir
    assert spec_name(source / "model.bin") == "WhisperSpec" and is_ct2_whisper(source)
    model = read_model(source / "model.bin")
    assert model.scalar("encoder/num_heads") == 2
    assert (
        model.variables["decoder/projection/weight"] is model.variables["decoder/embeddings/weight"]
    )
    (source / "model.bin").write_bytes((source / "model.bin").read_bytes()[:-3])
    with pytest.raises(CTranslate2Error):
        read_model(source / "model.bin")


def test_whisper_import_restores_every_weight(ct2_dir: tuple[Path, Model], tmp_path: Path):
    source, original = ct2_dir
    target = tmp_path / "mlx"
    target.mkdir()
    convert_ct2_whisper(source, target)
    assert ModelDimensions.from_dict(json.loads((target / "config.json").read_text())) == DIMS
    loaded = load_stt(target, dtype="float32", model_name="w")
    assert loaded.dtype == "float32" and not loaded.multilingual
    mine = dict(tree_flatten(loaded.model.parameters()))
    theirs = dict(tree_flatten(original.parameters()))
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():  # through float16, as CTranslate2 stored them
        expected = np.array(value).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(np.array(mine[name]), expected, err_msg=name)
    tokens = {
        t["content"]: t["id"]
        for t in json.loads((target / "tokenizer.json").read_text())["added_tokens"]
    }
    assert tokens["<|0.00|>"] == 38 and tokens["<|0.02|>"] == 39  # the timestamps it lacked
    heads = json.loads((target / "generation_config.json").read_text())["alignment_heads"]
    assert heads == [[0, 1]]


def test_subtitles():
    segments = [
        Segment(0, 0, 0.0, 2.5, " Hello there.", [], 0.0, -0.1, 1.0, 0.0),
        Segment(1, 0, 3661.25, 3662.0, " Bye.", [], 0.0, -0.1, 1.0, 0.0),
    ]
    assert timestamp(3661.25, ",") == "01:01:01,250"
    assert srt(segments) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
        "2\n01:01:01,250 --> 01:01:02,000\nBye.\n\n"
    )
    assert vtt(segments).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n")


def test_transcription_form():
    form = TranscriptionForm.model_validate({"model": "w", "stream": "true", "language": "EN"})
    assert form.stream is True and form.language == "en"
    assert form.timestamp_granularities == ["segment"] and form.response_format == "json"
    for bad in ({"language": "english"}, {"response_format": "mp3"}, {"temperature": "2"}):
        with pytest.raises(ValidationError):
            TranscriptionForm.model_validate({"model": "w", **bad})
