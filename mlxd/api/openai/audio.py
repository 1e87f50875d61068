"""OpenAI dialect: /v1/audio/transcriptions and /v1/audio/translations (kind stt).

The upload is decoded on the daemon's side (ffmpeg, in a thread) into the model's sample rate,
so the worker gets plain samples and a file ffmpeg cannot read is a 400 before any model work.
A streamed transcription (`stream=true`, as the OpenAI SDK sends it) is transcribed window by
window (30 s, Whisper's context), each window prompted with the text before it; its deltas leave
as each window finishes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Literal, Protocol, cast

from pydantic import ValidationError
from quart import Blueprint, Quart, Response, request
from werkzeug.datastructures import FileStorage

from mlxd.api.common.context import current_app
from mlxd.api.common.error_shapes import from_validation_error
from mlxd.api.middleware import auth, browser, observe
from mlxd.api.openai.audio_protocol import TranscriptionForm
from mlxd.api.openai.chat import sse
from mlxd.audio import codec, subtitles
from mlxd.config import SERVES
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest, RequestTooLarge
from mlxd.types import Segment, Transcript, TranscriptionRequest, Word

blueprint = Blueprint("audio", __name__)

# Whisper hears 16 kHz audio in 30 s windows.
SAMPLE_RATE = 16_000
WINDOW_S = 30
FORM_OVERHEAD = 64 * 1024  # the multipart framing and the other fields around the file


class Transcriber(Protocol):
    async def transcribe(self, request: TranscriptionRequest) -> Transcript: ...


def install(app: Quart) -> None:
    """Let uploads be as large as the largest stt model's audio.max_bytes (the server's
    max_request_bytes bounds every other body), before anything reads the form."""

    @app.before_request
    async def allow_audio_uploads() -> None:
        if request.path in browser.FORM_PATHS:
            config = current_app.daemon.config
            limits = [m.audio.max_bytes for m in config.models.values() if m.kind == "stt"]
            limit = max([config.server.max_request_bytes, *limits])
            request.max_content_length = limit + FORM_OVERHEAD


@blueprint.post("/v1/audio/transcriptions")
async def transcriptions() -> Any:
    return await _serve("transcribe")


@blueprint.post("/v1/audio/translations")
async def translations() -> Any:
    return await _serve("translate")


async def _serve(task: Literal["transcribe", "translate"]) -> Any:
    form, upload = await _read_form()
    if task == "translate" and (form.stream or form.language):
        field = "stream" if form.stream else "language"
        raise InvalidRequest(f"/v1/audio/translations takes no {field}", param=field)
    entry = entry_of_kind(form.model, "stt")
    audio = entry.config.audio
    data = upload.read(audio.max_bytes + 1)
    if len(data) > audio.max_bytes:
        raise RequestTooLarge(
            f"the audio file exceeds {audio.max_bytes} bytes (model '{form.model}', "
            "audio.max_bytes)",
            param="file",
        )
    samples = await asyncio.to_thread(
        codec.decode, data, sample_rate=SAMPLE_RATE, max_seconds=audio.max_seconds
    )
    engine = cast(Transcriber, await current_app.daemon.engine(entry.name, auth.caller()))
    job = TranscriptionRequest(
        samples,
        task=task,
        language=form.language,
        prompt=form.prompt,
        temperature=form.temperature,
        word_timestamps="word" in form.timestamp_granularities
        and form.response_format == "verbose_json",
    )
    if form.stream:
        headers = {"Cache-Control": "no-cache"}
        return Response(_stream(engine, job), content_type="text/event-stream", headers=headers)
    transcript = await engine.transcribe(job)
    return _render(transcript, form, task)


def entry_of_kind(model_id: str, kind: str) -> ModelEntry:
    """The model `model_id` names (if the caller may use it), which must be of `kind`."""
    entry = current_app.daemon.routes.entry(model_id, auth.caller())
    if entry.config.kind != kind:
        raise InvalidRequest(
            f"model '{model_id}' is of kind '{entry.config.kind}'; {request.path} needs a "
            f"model of kind '{kind}' ({SERVES.get(entry.config.kind, 'text generation')} is "
            "what it serves)",
            param="model",
        )
    return entry


async def _read_form() -> tuple[TranscriptionForm, FileStorage]:
    if not request.content_type or not request.content_type.startswith("multipart/form-data"):
        raise InvalidRequest(
            "the body must be multipart/form-data with the audio in `file` (as OpenAI's API "
            "takes it)"
        )
    fields = await request.form
    files = await request.files
    values: dict[str, Any] = {k: v for k, v in fields.items() if not k.endswith("[]")}
    if "model" in values:
        observe.requested(values["model"], current_app.daemon.routes.ids.get(values["model"]))
    granularities = fields.getlist("timestamp_granularities[]") or fields.getlist(
        "timestamp_granularities"
    )
    if granularities:
        values["timestamp_granularities"] = granularities
    try:
        form = TranscriptionForm.model_validate(values)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc
    upload = files.get("file")
    if upload is None:
        raise InvalidRequest("the form has no `file` (the audio to transcribe)", param="file")
    return form, upload


async def _stream(engine: Transcriber, job: TranscriptionRequest) -> AsyncIterator[bytes]:
    """OpenAI's transcription events: a `transcript.text.delta` per 30 s window, then
    `transcript.text.done` with the whole text."""
    window = WINDOW_S * SAMPLE_RATE
    texts: list[str] = []
    for start in range(0, len(job.samples), window):
        prompt = " ".join([job.prompt or "", *texts]).strip() or None
        part = await engine.transcribe(
            replace(job, samples=job.samples[start : start + window], prompt=prompt)
        )
        if part.text:
            texts.append(part.text)
            delta = part.text if len(texts) == 1 else " " + part.text
            yield sse({"type": "transcript.text.delta", "delta": delta})
    seconds = len(job.samples) / SAMPLE_RATE
    yield sse(
        {
            "type": "transcript.text.done",
            "text": " ".join(texts),
            "usage": {"type": "duration", "seconds": round(seconds)},
        }
    )


def _render(transcript: Transcript, form: TranscriptionForm, task: str) -> Any:
    fmt, plain = form.response_format, "text/plain; charset=utf-8"
    if fmt == "text":
        return Response(transcript.text + "\n", content_type=plain)
    if fmt == "srt":
        return Response(subtitles.srt(transcript.segments), content_type=plain)
    if fmt == "vtt":
        return Response(subtitles.vtt(transcript.segments), content_type="text/vtt; charset=utf-8")
    usage = {"type": "duration", "seconds": round(transcript.duration)}
    if fmt == "json":
        return {"text": transcript.text, "usage": usage}
    body: dict[str, Any] = {
        "task": task,
        "language": transcript.language,
        "duration": round(transcript.duration, 3),
        "text": transcript.text,
        "segments": [_segment(s) for s in transcript.segments],
        "usage": usage,
    }
    if "word" in form.timestamp_granularities:
        body["words"] = [_word(w) for w in transcript.words]
    return body


def _segment(s: Segment) -> dict[str, Any]:
    return {
        "id": s.id,
        "seek": s.seek,
        "start": round(s.start, 3),
        "end": round(s.end, 3),
        "text": s.text,
        "tokens": s.tokens,
        "temperature": s.temperature,
        "avg_logprob": s.avg_logprob,
        "compression_ratio": s.compression_ratio,
        "no_speech_prob": s.no_speech_prob,
    }


def _word(w: Word) -> dict[str, Any]:
    return {"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
