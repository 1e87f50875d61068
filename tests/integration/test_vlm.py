"""Images end to end: the real daemon serving a tiny random-weight Qwen2-VL (plus SmolLM2 as
a text-only model), spoken to with the official openai and anthropic SDKs."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest
from PIL import Image

from tests.integration.daemon import SMOL_GGUF, Daemon, start_daemon

pytestmark = pytest.mark.integration

MAX_TOKENS = 12


def png_bytes(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()


def openai_image(url: str, text: str = "Describe the image.") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "red.png").write_bytes(png_bytes(0))
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, mlxd_cache_dir: Path, tiny_vlm: Path, media_dir: Path):
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir), "media_dirs": [str(media_dir)]},
        "models": {
            "vlm": {"kind": "vlm", "source": str(tiny_vlm), "defaults": {"temperature": 0.0}},
            "smol": {"source": SMOL_GGUF, "context_length": 512},
        },
    }
    running = start_daemon(tmp_path_factory.mktemp("vlm-daemon"), config)
    yield running
    running.stop()


@pytest.fixture
def oai(daemon: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.url}/v1", api_key="x", max_retries=0)


@pytest.fixture
def claude(daemon: Daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)


def ask(client: openai.OpenAI, messages: list[dict], model: str = "vlm", **extra) -> str:
    options = {"max_tokens": MAX_TOKENS, "temperature": 0} | extra
    reply = client.chat.completions.create(model=model, messages=messages, **options)
    return reply.choices[0].message.content


def test_the_image_decides_the_answer(oai: openai.OpenAI):
    first, second, again = (ask(oai, openai_image(data_url(seed))) for seed in (0, 1, 0))
    assert first != second
    assert first == again
    assert ask(oai, [{"role": "user", "content": "Describe the image."}]) not in (first, second)


def test_usage_counts_the_image_tokens(oai: openai.OpenAI):
    text_only = oai.chat.completions.create(
        model="vlm", max_tokens=2, messages=[{"role": "user", "content": "Describe the image."}]
    )
    with_image = oai.chat.completions.create(
        model="vlm", max_tokens=2, messages=openai_image(data_url(0))
    )
    # A 64x64 image is 16 merged patches, inside <|vision_start|> … <|vision_end|>.
    assert with_image.usage.prompt_tokens == text_only.usage.prompt_tokens + 16 + 2


def test_anthropic_base64_agrees_with_openai_data_url(oai, claude: anthropic.Anthropic):
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes(1)).decode(),
    }
    reply = claude.messages.create(
        model="vlm",
        max_tokens=MAX_TOKENS,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert reply.content[0].text == ask(oai, openai_image(data_url(1)))


def test_streaming_equals_non_streaming(oai: openai.OpenAI):
    messages = openai_image(data_url(2))
    stream = oai.chat.completions.create(
        model="vlm", max_tokens=MAX_TOKENS, temperature=0, messages=messages, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == ask(oai, messages)


def test_image_and_text_requests_share_the_batch(daemon: Daemon, oai: openai.OpenAI):
    requests = [openai_image(data_url(seed)) for seed in (3, 4)] + [
        [{"role": "user", "content": "Name three colours."}],
        [{"role": "user", "content": "Count to five."}],
    ]
    # Greedy answers end after a few tokens, a few milliseconds: without the end token each
    # request runs 64 steps, so eight sent at once overlap however the machine schedules them.
    long = {"max_tokens": 64, "logit_bias": {"2": -100}}  # <|im_end|>
    alone = [ask(oai, messages, **long) for messages in requests]
    before = daemon.status()["models"]["vlm"]["multi_sequence_steps"]
    with ThreadPoolExecutor(len(requests) * 2) as pool:
        together = list(pool.map(lambda m: ask(oai, m, **long), requests * 2))
    assert together == alone * 2
    assert daemon.status()["models"]["vlm"]["multi_sequence_steps"] > before


def test_stop_strings_apply_to_image_requests(oai: openai.OpenAI):
    full = ask(oai, openai_image(data_url(1)))
    stop = full.split()[1]
    reply = oai.chat.completions.create(
        model="vlm",
        max_tokens=MAX_TOKENS,
        temperature=0,
        messages=openai_image(data_url(1)),
        stop=[stop],
    )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == full[: full.index(stop)]


def test_undecodable_image_is_a_400_naming_the_part(oai, claude: anthropic.Anthropic):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"},
                },
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(oai, messages)
    assert caught.value.body["param"] == "messages[0].content[1]"
    assert "messages[0].content[1]" in caught.value.body["message"]

    bad = {"type": "base64", "media_type": "image/png", "data": "!!!not base64!!!"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="vlm",
            max_tokens=4,
            messages=[
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": [{"type": "image", "source": bad}]},
            ],
        )
    assert "messages[2].content[0]" in caught.value.body["error"]["message"]


def test_files_only_under_media_dirs(oai: openai.OpenAI, media_dir: Path, tmp_path: Path):
    inside = media_dir / "red.png"
    assert ask(oai, openai_image(inside.as_uri())) == ask(oai, openai_image(data_url(0)))
    assert ask(oai, openai_image(str(inside))) == ask(oai, openai_image(data_url(0)))
    outside = tmp_path / "red.png"
    outside.write_bytes(png_bytes(0))
    for url in (outside.as_uri(), f"{media_dir}/../{outside.parent.name}/red.png"):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(oai, openai_image(url))
        assert "media_dirs" in caught.value.body["message"]


def test_remote_images_are_off_by_default(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(oai, openai_image("http://127.0.0.1:9/cat.png"))
    assert "allow_remote_media" in caught.value.body["message"]


def test_images_are_refused_by_a_text_only_model(oai, claude: anthropic.Anthropic):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(oai, openai_image(data_url(0)), model="smol")
    assert "does not accept images" in caught.value.body["message"]
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes(0)).decode(),
    }
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="smol",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": source}]}],
        )
    assert "does not accept images" in caught.value.body["error"]["message"]


def test_anthropic_stream_equals_non_streaming(claude: anthropic.Anthropic):
    source = {"type": "base64", "media_type": "image/png", "data": data_url(3).split(",")[1]}
    request = {
        "model": "vlm",
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
        "extra_body": {"temperature": 0},
    }
    with claude.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    reply = claude.messages.create(**request)
    assert streamed == reply.content[0].text
    assert final.usage.input_tokens == reply.usage.input_tokens


def test_aborted_image_stream_frees_its_slot(daemon: Daemon, oai: openai.OpenAI):
    # The tiny model can reach max_tokens before the close reaches the daemon (a busy
    # machine): such a run says nothing about aborts, so it is tried again.
    for _ in range(3):
        before = daemon.status()["models"]["vlm"]
        stream = oai.chat.completions.create(
            model="vlm",
            max_tokens=1500,
            messages=openai_image(data_url(4)),
            stream=True,
            # This image's greedy answer ends after 6 tokens: without its end token the
            # sequence runs on, so the close below cancels it instead of racing its end.
            logit_bias={"2": -100},  # <|im_end|>
        )
        assert sum(1 for _, _ in zip(stream, range(4), strict=False)) == 4
        stream.close()
        stats = daemon.wait_for_cancel("vlm", before["cancelled"])
        assert stats["running"] == 0
        if stats["finished"] == before["finished"]:
            break
    assert stats["cancelled"] == before["cancelled"] + 1


def test_ollama_images_are_the_same_images(daemon: Daemon, oai: openai.OpenAI):
    """Ollama's base64 `images` reach the model as the OpenAI route's image parts do."""
    import ollama

    client = ollama.Client(host=daemon.url, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_TOKENS}
    for seed in (1, 2):
        reply = client.chat(
            model="vlm",
            messages=[
                {"role": "user", "content": "Describe the image.", "images": [png_bytes(seed)]}
            ],
            options=options,
        )
        assert reply.message.content == ask(oai, openai_image(data_url(seed)))
    generated = client.generate(
        model="vlm", prompt="Describe the image.", images=[png_bytes(1)], options=options
    )
    assert generated.response == ask(oai, openai_image(data_url(1)))
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(
            model="vlm",
            messages=[{"role": "user", "content": "?", "images": [b"not an image"]}],
        )
    assert caught.value.status_code == 400 and "messages[0].images[0]" in caught.value.error


def test_an_image_bomb_is_refused_before_decoding(oai: openai.OpenAI, claude):
    """Two 1-bit 6000×6000 PNGs: a few KB each, 216 MB of RGB together once decoded. The
    sizes in their headers are over the request's pixel budget: refused undecoded, in both
    dialects, token counting included."""
    buffer = io.BytesIO()
    Image.new("1", (6000, 6000)).save(buffer, format="PNG")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    messages = openai_image(f"data:image/png;base64,{encoded}")
    messages[0]["content"].insert(1, messages[0]["content"][0])
    with pytest.raises(openai.BadRequestError) as caught:
        ask(oai, messages)
    assert caught.value.body["param"] == "images"
    assert "pixels" in caught.value.body["message"]
    source = {"type": "base64", "media_type": "image/png", "data": encoded}
    bomb = [{"role": "user", "content": [{"type": "image", "source": source}] * 2}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(model="vlm", messages=bomb)
    assert "pixels" in caught.value.body["error"]["message"]
