"""Hypothesis strategies for request bodies: each field either a plausible value (so many
bodies are valid, and reach the engine) or arbitrary JSON (so many are not), plus unknown
keys, non-object bodies and bytes that are not JSON. Valid bodies ask for at most 2 tokens."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MODELS = st.sampled_from(["smol", "smol", "default", "nope", "", "smol "])
SHORT_TEXT = st.text(max_size=24)
TOKENS = st.integers(0, 2)  # never a long generation: a valid max_tokens is 1 or 2

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | SHORT_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(SHORT_TEXT, inner, max_size=4),
    max_leaves=12,
)


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]):
    """Bodies for one endpoint: valid ones (each field from its plausible strategy), ones
    with a single field replaced by arbitrary JSON, ones where any field may be junk, any
    JSON document, and bytes that are mostly not JSON."""
    optional = {k: v for k, v in optional.items() if k not in required}
    every = {**required, **optional}
    valid = st.fixed_dictionaries(required, optional=optional)
    junk = {k: v | json_values for k, v in every.items()}

    @st.composite
    def one_wrong(draw: st.DrawFn) -> dict[str, Any]:
        result = draw(valid)
        result[draw(st.sampled_from(sorted(every)))] = draw(json_values)
        return result

    anything = st.builds(
        lambda fields, extra: {**extra, **fields},
        st.fixed_dictionaries({}, optional=junk),
        st.dictionaries(SHORT_TEXT, json_values, max_size=2),
    )
    return st.one_of(
        valid.map(json.dumps),
        one_wrong().map(json.dumps),
        anything.map(json.dumps),
        json_values.map(json.dumps),
        st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
    )


def _schema() -> st.SearchStrategy:
    leaf = st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "nope"])}
    )
    return st.one_of(
        leaf,
        st.fixed_dictionaries(
            {
                "type": st.just("object"),
                "properties": st.dictionaries(SHORT_TEXT, leaf, max_size=3),
            },
            optional={"required": st.lists(SHORT_TEXT, max_size=2)},
        ),
        st.fixed_dictionaries({"enum": st.lists(json_values, max_size=3)}),
        st.fixed_dictionaries({"$ref": SHORT_TEXT}),
    )


SAMPLING: dict[str, st.SearchStrategy] = {
    "max_tokens": TOKENS,
    "temperature": st.floats(0, 1),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 100),
    "stream": st.booleans(),
    "stop": st.lists(SHORT_TEXT, max_size=3) | SHORT_TEXT,
}

OPENAI_SAMPLING: dict[str, st.SearchStrategy] = {
    **SAMPLING,
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**70), 2**70),
    "n": st.integers(1, 2),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(
        st.integers(-(2**40), 2**40).map(str) | st.integers(0, 50000).map(str),
        st.floats(-100, 100),
        max_size=3,
    ),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": SHORT_TEXT,
}

_OPENAI_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f", ""])},
            optional={"description": SHORT_TEXT, "parameters": _schema()},
        ),
    }
)
_CONTENT_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "x"])},
    optional={
        "text": SHORT_TEXT,
        "image_url": st.fixed_dictionaries(
            {"url": st.sampled_from(["data:image/png;base64,AAAA", "http://x/y.png", "x"])}
        ),
    },
)
_CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])},
    optional={
        "content": SHORT_TEXT | st.lists(_CONTENT_PART, max_size=3) | st.none(),
        "name": SHORT_TEXT,
        "tool_call_id": SHORT_TEXT,
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": SHORT_TEXT,
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {"name": SHORT_TEXT, "arguments": SHORT_TEXT | st.just('{"a": 1}')}
                    ),
                }
            ),
            max_size=2,
        ),
    },
)

CHAT = body(
    {"model": MODELS, "messages": st.lists(_CHAT_MESSAGE, max_size=3)},
    {
        **OPENAI_SAMPLING,
        "max_completion_tokens": TOKENS,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 21),
        "tools": st.lists(_OPENAI_TOOL, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {"name": st.sampled_from(["get_weather", "f", "nope"])}
                ),
            }
        ),
        "parallel_tool_calls": st.booleans(),
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
            optional={
                "json_schema": st.fixed_dictionaries(
                    {"name": SHORT_TEXT}, optional={"schema": _schema(), "strict": st.booleans()}
                )
            },
        ),
    },
)

COMPLETION = body(
    {
        "model": MODELS,
        "prompt": SHORT_TEXT
        | st.lists(st.integers(-5, 60000), max_size=6)
        | st.lists(SHORT_TEXT, max_size=2)
        | st.lists(st.lists(st.integers(-5, 60000), max_size=4), max_size=2),
    },
    {
        **OPENAI_SAMPLING,
        "logprobs": st.integers(0, 21),
        "echo": st.booleans(),
        "suffix": SHORT_TEXT,
    },
)

_ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("image"),
            "source": st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["base64", "url", "x"]),
                    "media_type": st.sampled_from(["image/png", "text/plain"]),
                    "data": st.sampled_from(["AAAA", "!!"]),
                    "url": st.just("http://x/y.png"),
                }
            ),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": SHORT_TEXT,
            "name": SHORT_TEXT,
            "input": st.dictionaries(SHORT_TEXT, json_values, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": SHORT_TEXT,
            "content": SHORT_TEXT
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}), max_size=2
            ),
        },
        optional={"is_error": st.booleans()},
    ),
    st.fixed_dictionaries(
        {"type": st.just("thinking"), "thinking": SHORT_TEXT, "signature": SHORT_TEXT}
    ),
)
_ANTHROPIC_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "user", "assistant", "system"]),
        "content": SHORT_TEXT | st.lists(_ANTHROPIC_BLOCK, max_size=3),
    }
)
_ANTHROPIC_PROMPT: dict[str, st.SearchStrategy] = {
    "system": SHORT_TEXT
    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}), max_size=2),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["get_weather", "f", ""]), "input_schema": _schema()},
            optional={"description": SHORT_TEXT},
        ),
        max_size=2,
    ),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={
            "name": st.sampled_from(["get_weather", "f", "nope"]),
            "disable_parallel_tool_use": st.booleans(),
        },
    ),
    "thinking": st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled"]), "budget_tokens": st.integers(0, 2048)}
    ),
}
ANTHROPIC_REQUIRED = {"model": MODELS, "messages": st.lists(_ANTHROPIC_MESSAGE, max_size=3)}

MESSAGES = body(
    {**ANTHROPIC_REQUIRED, "max_tokens": TOKENS},
    {**_ANTHROPIC_PROMPT, **SAMPLING, "stop_sequences": st.lists(SHORT_TEXT, max_size=3),
     "metadata": st.dictionaries(SHORT_TEXT, json_values, max_size=2)},
)  # fmt: skip

COUNT_TOKENS = body(ANTHROPIC_REQUIRED, _ANTHROPIC_PROMPT)

_TOKEN_IDS = st.lists(st.integers(-5, 40_000), max_size=8)
EMBEDDINGS = body(
    {
        "model": st.sampled_from(["minilm", "minilm", "smol", "nope", ""]),
        "input": SHORT_TEXT
        | st.lists(SHORT_TEXT, max_size=4)
        | _TOKEN_IDS
        | st.lists(_TOKEN_IDS, max_size=3),
    },
    {
        "encoding_format": st.sampled_from(["float", "base64", "x"]),
        "dimensions": st.integers(-2, 500),
        "user": SHORT_TEXT,
    },
)

_OLLAMA_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 100),
        "num_predict": st.integers(-3, 2),
        "stop": st.lists(SHORT_TEXT, max_size=3) | SHORT_TEXT,
        "seed": st.integers(-(2**70), 2**70),
        "repeat_penalty": st.floats(0.5, 2),
        "num_ctx": st.integers(-1, 4096),
        "num_gpu": st.integers(-1, 99),
    },
)
_OLLAMA_COMMON: dict[str, st.SearchStrategy] = {
    "options": _OLLAMA_OPTIONS,
    "stream": st.booleans(),
    "format": st.sampled_from(["", "json", "xml"]) | _schema(),
    "keep_alive": st.sampled_from([-1, "5m", "1h", "soon", "-1m", 600]),  # never 0: no unloads
    "think": st.booleans() | st.sampled_from(["low", "max"]),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
}
_OLLAMA_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "assistant", "system", "tool", "x"])},
    optional={
        "content": SHORT_TEXT,
        "images": st.lists(st.sampled_from(["AAAA", "!!", "iVBORw0KGgo="]), max_size=2),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "function": st.fixed_dictionaries(
                        {
                            "name": st.sampled_from(["get_weather", ""]),
                            "arguments": st.dictionaries(SHORT_TEXT, json_values, max_size=2),
                        }
                    )
                }
            ),
            max_size=2,
        ),
        "tool_name": SHORT_TEXT,
    },
)
OLLAMA_MODELS = st.sampled_from(["smol", "smol:latest", "default", "minilm", "nope:7b", ""])
OLLAMA_CHAT = body(
    {"model": OLLAMA_MODELS, "messages": st.lists(_OLLAMA_MESSAGE, max_size=3)},
    {**_OLLAMA_COMMON, "tools": st.lists(_OPENAI_TOOL, max_size=2)},
)
OLLAMA_GENERATE = body(
    {"model": OLLAMA_MODELS, "prompt": SHORT_TEXT},
    {
        **_OLLAMA_COMMON,
        "system": SHORT_TEXT,
        "raw": st.booleans(),
        "images": st.lists(st.sampled_from(["AAAA", "!!"]), max_size=1),
        "template": SHORT_TEXT,
        "suffix": SHORT_TEXT,
        "context": st.lists(st.integers(0, 5), max_size=2),
    },
)
OLLAMA_EMBED = body(
    {"model": OLLAMA_MODELS, "input": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=3)},
    {"truncate": st.booleans(), "dimensions": st.integers(-2, 500), "keep_alive": st.just("5m")},
)

_RESPONSES_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "input_file", "x"])},
    optional={
        "text": SHORT_TEXT | json_values,
        "image_url": st.sampled_from(["data:image/png;base64,AAAA", "http://x/y.png", "x"]),
    },
)
_RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "user", "assistant", "system", "developer", "x"]),
            "content": SHORT_TEXT | st.lists(_RESPONSES_PART, max_size=3) | json_values,
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": SHORT_TEXT,
            "name": SHORT_TEXT,
            "arguments": SHORT_TEXT | st.just('{"a": 1}') | json_values,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": SHORT_TEXT,
            "output": SHORT_TEXT | st.lists(_RESPONSES_PART, max_size=2) | json_values,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "item_reference", "x"])},
        optional={"summary": json_values, "id": SHORT_TEXT},
    ),
    json_values,
)
RESPONSES = body(
    {"model": MODELS, "input": SHORT_TEXT | st.lists(_RESPONSES_ITEM, max_size=4)},
    {
        "instructions": SHORT_TEXT,
        "max_output_tokens": TOKENS,
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "stream": st.booleans(),
        "store": st.booleans(),
        "previous_response_id": st.sampled_from(["resp_0", "resp_../x", "x"]),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["function", "function", "web_search"])},
                optional={
                    "name": st.sampled_from(["get_weather", "f", ""]),
                    "parameters": _schema(),
                    "strict": st.booleans(),
                },
            ),
            max_size=2,
        ),
        "tool_choice": st.sampled_from(["auto", "none", "required", "x"])
        | st.fixed_dictionaries(
            {"type": st.just("function"), "name": st.sampled_from(["get_weather", "nope"])}
        ),
        "parallel_tool_calls": st.booleans(),
        "text": st.fixed_dictionaries(
            {
                "format": st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])},
                    optional={"name": SHORT_TEXT, "schema": _schema(), "strict": st.booleans()},
                )
            }
        ),
        "reasoning": st.fixed_dictionaries(
            {"effort": st.sampled_from(["low", "high"]), "summary": st.sampled_from(["auto"])}
        ),
        "metadata": st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=2),
        "include": st.lists(SHORT_TEXT, max_size=2),
    },
)

ENDPOINTS: dict[str, Any] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/v1/responses": RESPONSES,
    "/v1/messages": MESSAGES,
    "/v1/messages/count_tokens": COUNT_TOKENS,
    "/v1/embeddings": EMBEDDINGS,
    "/api/chat": OLLAMA_CHAT,
    "/api/generate": OLLAMA_GENERATE,
    "/api/embed": OLLAMA_EMBED,
}
