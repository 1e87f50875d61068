"""A transcription model (kind stt): Whisper through mlx-audio, one clip per model step.

mlx-audio's `generate` is Whisper's own long-form algorithm: 30 s windows, each seeking to the
last timestamp the model emitted (so no word is cut at a window's edge), the previous window's
text as the next one's prompt, temperature fallback on repetitive or unlikely output, and word
times from the cross-attention alignment heads. Its timestamps are offsets into the whole clip.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

from mlxd.config import ModelConfig, ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.models.speech import LoadedSTT, load_stt
from mlxd.types import Segment, Transcript, TranscriptionRequest, Word
from mlxd.worker.jobs import run_job, start_jobs
from mlxd.worker.speech import SpeechEngine

# OpenAI's temperature 0: start greedy and raise the temperature while the output fails
# Whisper's checks (compression ratio, average log probability).
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


class STTEngine(SpeechEngine[LoadedSTT]):
    kind = "stt"

    @classmethod
    async def load(
        cls, name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
    ) -> STTEngine:
        load = partial(load_stt, path, dtype=config.dtype, model_name=name)
        return cls(name, config, *await start_jobs(name, "transcription", config, load))

    async def transcribe(self, request: TranscriptionRequest) -> Transcript:
        if request.language not in (None, "en") and not self.loaded.multilingual:
            raise InvalidRequest(
                f"model '{self.name}' is English-only; language must be 'en' or omitted",
                param="language",
            )
        with self.serving():
            return await run_job(self.loop, lambda: self._run(request))

    def _run(self, request: TranscriptionRequest) -> Transcript:
        """On the model thread."""
        temperature = FALLBACK_TEMPERATURES if request.temperature == 0 else (request.temperature,)
        output = self.loaded.model.generate(
            request.samples,
            language=request.language,
            task=request.task,
            temperature=temperature,
            initial_prompt=request.prompt,
            word_timestamps=request.word_timestamps,
            fp16=self.loaded.dtype == "float16",
            verbose=None,
        )
        code = output.language or request.language or "en"
        duration = len(request.samples) / self.loaded.sample_rate
        self.audio_seconds += duration
        segments = [_segment(raw) for raw in output.segments or []]
        words = [
            Word(w["word"], float(w["start"]), float(w["end"]))
            for raw in output.segments or []
            for w in raw.get("words", [])
        ]
        return Transcript(
            text=output.text.strip(),
            language=LANGUAGES.get(code, code),
            duration=duration,
            segments=segments,
            words=words,
        )

    def model_stats(self) -> dict[str, Any]:
        return {"dtype": self.loaded.dtype, "multilingual": self.loaded.multilingual}


def _segment(raw: dict[str, Any]) -> Segment:
    def number(key: str) -> float:
        value = float(raw.get(key, 0.0))
        return value if math.isfinite(value) else 0.0

    return Segment(
        id=int(raw["id"]),
        seek=int(raw.get("seek", 0)),
        start=number("start"),
        end=number("end"),
        text=raw["text"],
        tokens=[int(t) for t in raw.get("tokens", [])],
        temperature=number("temperature"),
        avg_logprob=number("avg_logprob"),
        compression_ratio=number("compression_ratio"),
        no_speech_prob=number("no_speech_prob"),
    )
