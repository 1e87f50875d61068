"""OpenAI's audio request bodies: the multipart form of /v1/audio/transcriptions and
/v1/audio/translations, validated with pydantic like the JSON bodies."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TranscriptFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
Granularity = Literal["word", "segment"]
_SEGMENT: list[Granularity] = ["segment"]


class TranscriptionForm(BaseModel):
    """The form fields besides `file` (unknown ones, e.g. chunking_strategy, are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    language: str | None = None
    prompt: str | None = None
    response_format: TranscriptFormat = "json"
    temperature: float = Field(0.0, ge=0, le=1)
    timestamp_granularities: list[Granularity] = Field(default_factory=lambda: list(_SEGMENT))
    stream: bool = False

    @field_validator("language")
    @classmethod
    def _iso_639_1(cls, language: str | None) -> str | None:
        if language is None or language == "":
            return None
        if not (len(language) == 2 and language.isalpha()):
            raise ValueError("must be an ISO-639-1 code such as 'en'")
        return language.lower()


class TranscriptionUpload(TranscriptionForm):
    """The whole multipart form, as the OpenAPI document describes it."""

    file: bytes = Field(description="The audio: flac, m4a, mp3, mp4, mpeg, ogg, wav, webm …")


class SpeechBody(BaseModel):
    """POST /v1/audio/speech (JSON). `instructions` (gpt-4o-mini-tts's style prompt) is
    accepted and ignored: the voice sets the style."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    input: str = Field(min_length=1)
    voice: str = Field(min_length=1)
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
