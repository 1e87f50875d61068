"""The Ollama dialect's translation, without a daemon: messages in, parsed parts out."""

from __future__ import annotations

import asyncio
import math

import pytest

from mlxd.api.common.parts import Logprobs, parsed_events
from mlxd.api.ollama.protocol import ChatRequest, GenerateRequest, Message, keep_alive_seconds
from mlxd.api.ollama.render import fold, iso_time, parse_arguments
from mlxd.api.ollama.routes import Timing, internal_message, message_chunks
from mlxd.parsers.registry import compose, make_reasoning_parser, make_tool_parser
from mlxd.types import Delta, Finished, TokenLogprob


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("", None),
        (0, 0.0),
        ("0", 0.0),
        (300, 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("500ms", 0.5),
        (-1, math.inf),
        ("-1", math.inf),
        ("-1m", math.inf),
    ],
)
def test_keep_alive_in_seconds(value, seconds):
    assert keep_alive_seconds(value) == seconds


def test_bad_keep_alive_names_the_field():
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds("soon")


def test_images_become_the_openai_image_parts():
    message = Message(role="user", content="What is this?", images=["iVBORw0KGgo="])
    internal = internal_message(message, 2)
    image, text = internal["content"]
    assert image["type"] == "image_url"
    assert image["image_url"]["url"] == "data:image;base64,iVBORw0KGgo="
    assert image["param"] == "messages[2].images[0]"  # errors name the Ollama field
    assert text == {"type": "text", "text": "What is this?"}


def test_tool_calls_and_results_keep_ollamas_shape_inward():
    call = Message.model_validate(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
        }
    )
    internal = internal_message(call, 1)
    assert internal["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    result = internal_message(Message(role="tool", content="42", tool_name="f"), 2)
    assert result == {"role": "tool", "content": "42", "name": "f"}


def test_defaults_are_ollamas():
    chat = ChatRequest.model_validate({"model": "m", "messages": []})
    assert chat.stream is True  # NDJSON unless told otherwise
    generate = GenerateRequest.model_validate(
        {"model": "m", "prompt": "p", "options": {"stop": "x", "num_gpu": 99, "mirostat": 1}}
    )
    assert generate.options.stop == ["x"]  # llama.cpp knobs are accepted and ignored


async def _chunks(texts: list[str], *, think: bool = True, logprobs: bool = False) -> list[dict]:
    async def events():
        for text in texts:
            items = [TokenLogprob(text, -0.5, [(text, -0.5)])] if logprobs else None
            yield Delta(text, [1], items)
        yield Finished("stop", prompt_tokens=7, completion_tokens=len(texts))

    parser = compose(make_tool_parser("hermes"), make_reasoning_parser("think"))
    parts = parsed_events(parser, events())
    return [chunk async for chunk in message_chunks(parts, Timing(), think=think)]


def test_tool_call_goes_out_whole_with_an_arguments_object():
    text = [
        '<tool_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n',
        "</tool_call>",
    ]
    chunks = asyncio.run(_chunks(text))
    calls = [c["tool_calls"] for c in chunks if "tool_calls" in c]
    assert len(calls) == 1
    assert calls[0][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    final = chunks[-1]
    assert final["done"] is True and final["done_reason"] == "stop"
    assert final["prompt_eval_count"] == 7 and final["eval_count"] == 3
    assert final["total_duration"] >= final["eval_duration"] >= 0


def test_thinking_is_split_off_unless_think_is_false():
    text = ["<think>", "hmm", "</think>", "Paris"]
    folded = asyncio.run(fold(_as_async(asyncio.run(_chunks(text)))))
    assert folded["thinking"] == "hmm" and folded["content"] == "Paris"
    hidden = asyncio.run(fold(_as_async(asyncio.run(_chunks(text, think=False)))))
    assert "thinking" not in hidden and hidden["content"] == "Paris"


def test_logprobs_are_ollamas_shape():
    chunks = asyncio.run(_chunks(["a", "b"], logprobs=True))
    items = [item for c in chunks for item in c.get("logprobs", [])]
    assert items[0] == {
        "token": "a",
        "logprob": -0.5,
        "top_logprobs": [{"token": "a", "logprob": -0.5}],
    }
    assert not any(isinstance(c, Logprobs) for c in chunks)


async def _as_async(items):
    for item in items:
        yield item


def test_parse_arguments_never_drops_what_the_model_said():
    assert parse_arguments('{"a": 1}') == {"a": 1}
    assert parse_arguments("") == {}
    assert parse_arguments("not json") == {"arguments": "not json"}
    assert parse_arguments("[1]") == {"arguments": [1]}


def test_created_at_is_rfc3339_utc():
    assert iso_time(0) == "1970-01-01T00:00:00Z"
