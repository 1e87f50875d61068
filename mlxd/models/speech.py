"""Loading speech models through mlx-audio's own model classes.

Transcription: Whisper (mlx_audio.stt.models.whisper), built with the dtype the backend runs
best (float32 on the CPU, where float16 is slower; as stored on Metal/CUDA) and its processor
attached by mlx-audio's own post-load hook. Whisper directories come from the Hugging Face/MLX
layout or from a CTranslate2 import (models/whisper_ct2.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxd.accel import backend_name
from mlxd.errors import ModelLoadError
from mlxd.models.loader import flat_parameters


@dataclass
class LoadedSTT:
    model: Any  # mlx_audio.stt.models.whisper.Model
    dtype: str
    nbytes: int
    sample_rate: int
    multilingual: bool


def load_stt(path: Path, *, dtype: str, model_name: str) -> LoadedSTT:
    from mlx_audio.stt.models.whisper import audio as whisper_audio
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    config = json.loads((path / "config.json").read_text())
    model_type = config.get("model_type", "whisper")
    if model_type != "whisper":
        raise ModelLoadError(
            f"model '{model_name}': kind stt serves Whisper models; {path} is {model_type!r}"
        )
    target = _compute_dtype(dtype)
    model = Model(ModelDimensions.from_dict(config), dtype=target)
    weights: dict[str, mx.array] = {}
    for file in sorted(path.glob("*.safetensors")):
        loaded = mx.load(str(file))
        assert isinstance(loaded, dict)  # a safetensors file holds named arrays
        weights.update(loaded)
    if not weights:
        raise ModelLoadError(f"model '{model_name}': {path} has no *.safetensors weights")
    weights = model.sanitize(weights)  # Hugging Face names → mlx-audio's; casts to `target`
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"model '{model_name}': weights do not fit Whisper: {exc}") from exc
    mx.eval(model.parameters())
    model.eval()
    model = Model.post_load_hook(model, path)  # the tokenizer, the alignment heads
    nbytes = sum(array.nbytes for _, array in flat_parameters(model))
    name = str(target).removeprefix("mlx.core.")
    return LoadedSTT(model, name, nbytes, whisper_audio.SAMPLE_RATE, model.is_multilingual)


def _compute_dtype(dtype: str) -> mx.Dtype:
    """mlx-audio's Whisper decodes in float16 or float32 only."""
    if dtype == "float32" or (dtype == "auto" and backend_name() == "cpu"):
        return mx.float32
    return mx.float16


@dataclass
class LoadedTTS:
    model: Any  # an mlx-audio TTS model (its generate() yields audio segments)
    nbytes: int
    sample_rate: int
    voices: list[str]  # what a request's `voice` may name (aliases included)


def load_tts(path: Path, *, model_name: str) -> LoadedTTS:
    """Any mlx-audio TTS architecture its own loader knows (Kokoro, KittenTTS …)."""
    from mlx_audio.tts.utils import load_model

    try:
        model = load_model(str(path))
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise ModelLoadError(f"model '{model_name}': mlx-audio cannot load {path}: {exc}") from exc
    voices = sorted(getattr(model, "voices", None) or {})
    voices += sorted(getattr(model.config, "voice_aliases", None) or {})
    if not voices and (path / "voices").is_dir():  # Kokoro: one file per voice
        voices = sorted(p.stem for p in (path / "voices").iterdir() if p.is_file())
    nbytes = sum(array.nbytes for _, array in flat_parameters(model))
    return LoadedTTS(model, nbytes, int(model.sample_rate), voices)
