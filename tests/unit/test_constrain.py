"""Constrained decoding with the real SmolLM2 weights and tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_tokenizer

from mlxd.constrain import Constrainer, make_processor
from mlxd.models.loader import LoadedModel

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
TOOL_CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def loaded(smol: LoadedModel) -> LoadedModel:
    """The session's SmolLM2 (tests/unit/conftest.py)."""
    return smol


@pytest.fixture(scope="module")
def constrainer(smol: LoadedModel) -> Constrainer:
    return Constrainer(load_tokenizer(smol.path))


def chat(loaded: LoadedModel, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def generate(
    loaded: LoadedModel, items: list[tuple[list[int], Any]], max_tokens: int = 60
) -> list[str]:
    """Greedy texts for (prompt, processor or None), all in one BatchGenerator."""
    tokenizer = loaded.tokenizer
    generator = BatchGenerator(loaded.model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    uids = generator.insert(
        [prompt for prompt, _ in items],
        max_tokens=[max_tokens] * len(items),
        logits_processors=[[p] if p else [] for _, p in items],
    )
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, str] = {}
    while len(finished) < len(uids):
        for response in generator.next_generated():
            if response.finish_reason != "stop":
                tokens[response.uid].append(response.token)
            if response.finish_reason:
                finished[response.uid] = response.finish_reason
    generator.close()
    # A grammar ends its sequence with EOS well before the token limit.
    for uid, (_, processor) in zip(uids, items, strict=True):
        assert processor is None or finished[uid] == "stop", tokenizer.decode(tokens[uid])
    return [tokenizer.decode(tokens[uid]) for uid in uids]


def grammar_processor(constrainer: Constrainer, grammar: str, loaded: LoadedModel):
    return make_processor(constrainer, grammar, loaded.tokenizer.eos_token_ids)


def parse_tool_call(text: str) -> dict[str, Any]:
    match = TOOL_CALL.fullmatch(text)
    assert match, text
    return json.loads(match.group(1))


def test_json_object(loaded, constrainer):
    prompt = chat(loaded, "Describe a cat.")
    [text] = generate(
        loaded, [(prompt, grammar_processor(constrainer, constrainer.json_object(), loaded))]
    )
    assert isinstance(json.loads(text), dict)


def test_json_schema(loaded, constrainer):
    prompt = chat(loaded, "Make up a person with a name, an age and a favourite color.")
    grammar = constrainer.json_schema(PERSON)
    [text] = generate(loaded, [(prompt, grammar_processor(constrainer, grammar, loaded))])
    person = json.loads(text)
    assert set(person) == {"name", "age", "color"}
    assert isinstance(person["name"], str)
    assert isinstance(person["age"], int) and not isinstance(person["age"], bool)
    assert person["color"] in ("red", "green", "blue")


def test_tool_call(loaded, constrainer):
    prompt = chat(loaded, "What is the weather in Paris?")
    grammar = constrainer.tool_call([WEATHER])
    [text] = generate(loaded, [(prompt, grammar_processor(constrainer, grammar, loaded))])
    call = parse_tool_call(text)
    assert call["name"] == "get_weather"
    assert set(call["arguments"]) == {"city"} and isinstance(call["arguments"]["city"], str)


def test_forced_tool_among_two(loaded, constrainer):
    # The question fits get_weather; the forced name must win anyway.
    prompt = chat(loaded, "What is the weather in Paris?")
    grammar = constrainer.tool_call([WEATHER, TIME], name="get_time")
    [text] = generate(loaded, [(prompt, grammar_processor(constrainer, grammar, loaded))])
    call = parse_tool_call(text)
    assert call["name"] == "get_time"
    assert isinstance(call["arguments"]["timezone"], str)


def test_constrained_neighbours_leave_others_untouched(loaded, constrainer):
    free = [chat(loaded, "Write a haiku about the sea."), chat(loaded, "What is 2+2?")]
    constrained = [
        (chat(loaded, "Describe a dog."), constrainer.json_object()),
        (chat(loaded, "Weather in Oslo?"), constrainer.tool_call([WEATHER, TIME])),
    ]
    alone = generate(loaded, [(p, None) for p in free])
    items = [(free[0], None)]
    items += [(p, grammar_processor(constrainer, g, loaded)) for p, g in constrained]
    items += [(free[1], None)]
    mixed = generate(loaded, items)
    assert [mixed[0], mixed[3]] == alone
    assert isinstance(json.loads(mixed[1]), dict)
    assert parse_tool_call(mixed[2])["name"] in ("get_weather", "get_time")


# -- without the model: tokenizer and matcher only -------------------------------------------


def tokens_of(constrainer: Constrainer, text: str) -> list[int]:
    return constrainer.tokenizer.tokenize_str(text)


def allowed_ids(logits: mx.array) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.array(logits[0]))).tolist())


def test_processor_follows_context_and_masks_padding(constrainer):
    eos = {2}
    proc = make_processor(constrainer, constrainer.json_object(), eos)
    vocab = constrainer.tokenizer.vocab_size
    padded = mx.zeros((1, vocab + 64))  # a model vocabulary padded past the tokenizer's
    prompt = [1, 9690, 198]
    # First call: the context is the prompt only; nothing is consumed.
    first = allowed_ids(proc(mx.array(prompt), padded))
    assert first and all(constrainer.tokenizer.decode_str([t]).startswith("{") for t in first)
    answer = tokens_of(constrainer, '{"a": [1, 2]}')
    context = list(prompt)
    for token in answer:
        context.append(token)
        allowed = allowed_ids(proc(mx.array(context), padded))
        assert all(t < vocab for t in allowed)
    # The object is closed: only EOS remains, also after EOS comes back in the context.
    assert allowed == eos
    assert allowed_ids(proc(mx.array([*context, 2]), padded)) == eos


def test_invalid_schema_is_a_value_error_with_llguidance_message(constrainer):
    with pytest.raises(ValueError, match="Unimplemented keys"):
        make_processor(constrainer, constrainer.json_schema({"not": {"type": "string"}}), [2])
    with pytest.raises(ValueError, match="strin"):
        make_processor(constrainer, constrainer.json_schema({"type": "strin"}), [2])
    with pytest.raises(ValueError):
        constrainer.json_schema(["not", "a", "schema"])  # type: ignore[arg-type]


def test_tool_call_errors(constrainer):
    with pytest.raises(ValueError, match="'mistral'"):
        constrainer.tool_call([WEATHER], format="mistral")
    with pytest.raises(ValueError, match="'get_time'"):
        constrainer.tool_call([WEATHER], name="get_time")
    with pytest.raises(ValueError):
        constrainer.tool_call([{"type": "function", "function": {}}])


def matcher_accepts(constrainer: Constrainer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(constrainer.tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokens_of(constrainer, text)) and matcher.is_accepting()


def test_parallel_tool_calls(constrainer):
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    two = one + "\n" + one.replace("get_weather", "get_time").replace("city", "timezone")
    assert matcher_accepts(constrainer, constrainer.tool_call([WEATHER, TIME]), one)
    assert not matcher_accepts(constrainer, constrainer.tool_call([WEATHER, TIME]), two)
    assert matcher_accepts(constrainer, constrainer.tool_call([WEATHER, TIME], parallel=True), two)


def test_tool_parameters_with_refs(constrainer):
    # Pydantic-made schemas point into their own "$defs": they must resolve within `parameters`.
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "$defs": {"City": {"enum": ["Oslo", "Paris"]}},
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/City"}},
                "required": ["city"],
            },
        },
    }
    grammar = constrainer.tool_call([tool, TIME])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    assert matcher_accepts(constrainer, grammar, call % "Oslo")
    assert not matcher_accepts(constrainer, grammar, call % "Rome")


def test_tool_call_tag_that_is_a_special_token(smol: LoadedModel):
    # Hermes-style models often have <tool_call> as a special token: the grammar must allow
    # that token, since special tokens never match quoted text.
    tokenizer = load_tokenizer(smol.path)._tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    constrainer = Constrainer(tokenizer)
    grammar = constrainer.tool_call([WEATHER])
    matcher = llguidance.LLMatcher(constrainer.tokenizer, grammar, log_level=0)
    body = '\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    tags = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert matcher.consume_tokens([tags[0], *tokens_of(constrainer, body), tags[1]])
    assert matcher.is_accepting()
