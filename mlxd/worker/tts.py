"""A speech model (kind tts): an mlx-audio TTS model, one synthesis per model step."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.config import ModelConfig, ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.models.speech import LoadedTTS, load_tts
from mlxd.types import Speech, SpeechRequest
from mlxd.worker.jobs import run_job, start_jobs
from mlxd.worker.speech import SpeechEngine

SYNTHESIS_SEED = 0


class TTSEngine(SpeechEngine[LoadedTTS]):
    kind = "tts"

    @classmethod
    async def load(
        cls, name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
    ) -> TTSEngine:
        load = partial(load_tts, path, model_name=name)
        return cls(name, config, *await start_jobs(name, "speech synthesis", config, load))

    def voice(self, requested: str) -> str:
        """The model's voice for `requested`: its own, else audio.voice (so clients that only
        know OpenAI's alloy, echo … still get speech), else a 400 listing the voices."""
        if requested in self.loaded.voices:
            return requested
        fallback = self.config.audio.voice
        if fallback is not None:
            return fallback
        raise InvalidRequest(
            f"model '{self.name}' has no voice '{requested}'; its voices: "
            f"{', '.join(self.loaded.voices) or 'none'} (audio.voice sets a fallback)",
            param="voice",
        )

    async def speak(self, request: SpeechRequest) -> Speech:
        resolved = SpeechRequest(request.text, self.voice(request.voice), request.speed)
        with self.serving():
            return await run_job(self.loop, lambda: self._run(resolved))

    def _run(self, request: SpeechRequest) -> Speech:
        """On the model thread: every segment mlx-audio yields, in order. Vocoders add noise
        (unvoiced sounds); a fixed seed makes the same input speak the same audio."""
        mx.random.seed(SYNTHESIS_SEED)
        parts = [
            np.array(segment.audio.astype(mx.float32)).reshape(-1)
            for segment in self.loaded.model.generate(
                request.text, voice=request.voice, speed=request.speed
            )
        ]
        samples = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        self.audio_seconds += len(samples) / self.loaded.sample_rate
        return Speech(samples, self.loaded.sample_rate)

    def model_stats(self) -> dict[str, Any]:
        return {"sample_rate": self.loaded.sample_rate, "voices": self.loaded.voices}
