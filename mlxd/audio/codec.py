"""Decoding and encoding audio through ffmpeg (Debian's `ffmpeg`), a thin subprocess wrapper.

ffmpeg reads every container and codec a client may upload (wav, mp3, m4a, ogg/opus, webm from
a browser's recorder, flac …) and writes every format OpenAI's speech endpoint offers. It runs
as a child process on the daemon's side: a malformed file can crash it, never the daemon, and
the model worker receives plain float32 samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from mlxd.errors import InvalidRequest, MlxdError

# OpenAI's `pcm` is 16-bit little-endian mono at 24 kHz; mlxd writes every format at that rate.
OUTPUT_RATE = 24_000
READ_CHUNK = 16_384


class AudioUnavailable(MlxdError):
    status = 500
    kind = "server_error"


@dataclass(frozen=True)
class OutputFormat:
    media_type: str
    args: tuple[str, ...]  # ffmpeg's output options
    streams: bool  # playable while it is still being written


OUTPUT_FORMATS = {
    "mp3": OutputFormat("audio/mpeg", ("-c:a", "libmp3lame", "-b:a", "64k", "-f", "mp3"), True),
    "opus": OutputFormat("audio/ogg", ("-c:a", "libopus", "-b:a", "32k", "-f", "ogg"), True),
    "aac": OutputFormat("audio/aac", ("-c:a", "aac", "-b:a", "64k", "-f", "adts"), True),
    "flac": OutputFormat("audio/flac", ("-c:a", "flac", "-f", "flac"), True),
    # A piped wav header cannot know its length: players read it to the end regardless.
    "wav": OutputFormat("audio/wav", ("-c:a", "pcm_s16le", "-f", "wav"), True),
    "pcm": OutputFormat("audio/pcm", ("-c:a", "pcm_s16le", "-f", "s16le"), True),
}


def _ffmpeg() -> str:
    path = shutil.which("ffmpeg")
    if path is None:
        raise AudioUnavailable(
            "ffmpeg is not installed on the server (Debian/Ubuntu: apt-get install ffmpeg; "
            "macOS: brew install ffmpeg); mlxd needs it to read and write audio"
        )
    return path


def decode(data: bytes, *, sample_rate: int, max_seconds: float, param: str = "file") -> np.ndarray:
    """Mono float32 samples at `sample_rate` of an audio file's bytes; blocking.

    400 for bytes ffmpeg cannot read or audio longer than `max_seconds`.
    """
    if not data:
        raise InvalidRequest("the audio file is empty", param=param)
    # A file, not a pipe: MP4/M4A keep their index at the end and need seeking.
    with tempfile.NamedTemporaryFile(prefix="mlxd-audio-") as upload:
        upload.write(data)
        upload.flush()
        done = subprocess.run(
            [
                _ffmpeg(),
                *("-nostdin", "-hide_banner", "-loglevel", "error", "-i", upload.name),
                # One sample past the cap is enough to know the file is too long.
                *("-t", f"{max_seconds + 1:.3f}", "-vn", "-ac", "1", "-ar", str(sample_rate)),
                *("-f", "f32le", "pipe:1"),
            ],
            capture_output=True,
            check=False,
        )
    samples = np.frombuffer(done.stdout, dtype="<f4")
    if done.returncode != 0 or samples.size == 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()
        detail = f": {reason[-1]}" if reason else ""
        raise InvalidRequest(
            f"could not decode the audio file (supported: flac, m4a, mp3, mp4, mpeg, mpga, "
            f"oga, ogg, wav, webm){detail.replace(upload.name, 'file')}",
            param=param,
        )
    if samples.size > max_seconds * sample_rate:
        raise InvalidRequest(
            f"the audio is longer than this model accepts ({max_seconds:g} s, audio.max_seconds)",
            param=param,
        )
    return samples.astype(np.float32)


async def encode(
    samples: np.ndarray, *, sample_rate: int, response_format: str
) -> AsyncIterator[bytes]:
    """`samples` (mono float32 at `sample_rate`) in `response_format`, yielded as ffmpeg
    writes it: the first bytes leave before the whole clip is encoded."""
    spec = OUTPUT_FORMATS[response_format]
    process = await asyncio.create_subprocess_exec(
        _ffmpeg(),
        *("-nostdin", "-hide_banner", "-loglevel", "error"),
        *("-f", "f32le", "-ac", "1", "-ar", str(sample_rate), "-i", "pipe:0"),
        *("-ar", str(OUTPUT_RATE), *spec.args, "pipe:1"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdin and process.stdout and process.stderr  # all three are pipes

    async def feed() -> None:
        assert process.stdin
        with contextlib.suppress(ConnectionError):
            process.stdin.write(np.ascontiguousarray(samples, dtype="<f4").tobytes())
            await process.stdin.drain()
        process.stdin.close()

    feeding = asyncio.create_task(feed())
    try:
        while chunk := await process.stdout.read(READ_CHUNK):
            yield chunk
        await feeding
        errors = await process.stderr.read()
        if await process.wait() != 0:
            raise AudioUnavailable(f"ffmpeg could not encode {response_format}: {errors.decode()}")
    finally:
        feeding.cancel()
        if process.returncode is None:  # the client went away mid-stream
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
