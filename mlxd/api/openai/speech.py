"""OpenAI dialect: /v1/audio/speech (kind tts), and the voices of a speech model.

The model synthesizes the whole input; ffmpeg then encodes it while the response streams, so a
client plays the first bytes before the encoding ends. `stream_format: sse` sends the same
bytes base64-encoded in `speech.audio.delta` events, as OpenAI's API does.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any, Protocol, cast

from quart import Blueprint, Response, request

from mlxd.api.common.context import current_app
from mlxd.api.common.generation import parse_body
from mlxd.api.middleware import auth
from mlxd.api.openai.audio import entry_of_kind
from mlxd.api.openai.audio_protocol import SpeechBody
from mlxd.api.openai.chat import sse
from mlxd.audio import codec
from mlxd.errors import InvalidRequest
from mlxd.types import Speech, SpeechRequest

blueprint = Blueprint("speech", __name__)


class Speaker(Protocol):
    async def speak(self, request: SpeechRequest) -> Speech: ...


@blueprint.post("/v1/audio/speech")
async def speech() -> Any:
    body = await parse_body(SpeechBody)
    entry = entry_of_kind(body.model, "tts")
    limit = entry.config.audio.max_input_chars
    if len(body.input) > limit:
        raise InvalidRequest(
            f"input is {len(body.input)} characters; model '{body.model}' takes at most "
            f"{limit} (audio.max_input_chars)",
            param="input",
        )
    engine = cast(Speaker, await current_app.daemon.engine(entry.name, auth.caller()))
    spoken = await engine.speak(SpeechRequest(body.input, body.voice, body.speed))
    audio = codec.encode(
        spoken.samples, sample_rate=spoken.sample_rate, response_format=body.response_format
    )
    if body.stream_format == "sse":
        return Response(_events(audio), content_type="text/event-stream")
    media_type = codec.OUTPUT_FORMATS[body.response_format].media_type
    return Response(audio, content_type=media_type)


async def _events(audio: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async for chunk in audio:
        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
    yield sse({"type": "speech.audio.done"})


@blueprint.get("/v1/audio/voices")
async def voices() -> Any:
    """The voices of `?model=` (loading it if needed): `{"voices": [{"id", "name"}]}`."""
    model_id = request.args.get("model", "")
    if not model_id:
        raise InvalidRequest("name the speech model: /v1/audio/voices?model=ID", param="model")
    entry = entry_of_kind(model_id, "tts")
    engine = await current_app.daemon.engine(entry.name, auth.caller())
    await engine.refresh_stats()
    names = engine.stats().get("voices", [])
    return {"voices": [{"id": name, "name": name} for name in names]}
