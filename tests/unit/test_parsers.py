"""Streaming output parsers: every text gives the same result whole, split in two at every
position, and one char at a time."""

import json
import re
from collections.abc import Callable

import pytest

from mlxd.parsers.base import (
    OutputPart,
    ReasoningPart,
    StreamParser,
    TextPart,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxd.parsers.registry import compose, make_reasoning_parser, make_tool_parser


def normalise(parts: list[OutputPart]) -> list[tuple]:
    """Adjacent text/reasoning merged, each call as ("call", name, arguments); arguments are
    decoded when they are valid JSON. Also checks the call bookkeeping on the way."""
    out: list[tuple] = []
    args: dict[int, str] = {}
    open_calls: set[int] = set()
    ids = set()
    for part in parts:
        match part:
            case TextPart(text) | ReasoningPart(text):
                kind = "text" if isinstance(part, TextPart) else "reasoning"
                assert text, "empty text part"
                if out and out[-1][0] == kind:
                    text = out.pop()[1] + text
                out.append((kind, text))
            case ToolCallStart(index, call_id, name):
                assert index == len(args), "indexes count calls from 0"
                assert re.fullmatch(r"call_[0-9a-f]{24}", call_id) and call_id not in ids
                ids.add(call_id)
                args[index] = ""
                open_calls.add(index)
                out.append(("call", name, index))
            case ToolCallArgs(index, fragment):
                assert index in open_calls
                args[index] += fragment
            case ToolCallEnd(index):
                open_calls.remove(index)
    assert not open_calls, "every call ends"
    return [(*item[:2], _decode(args[item[2]])) if item[0] == "call" else item for item in out]


def _decode(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def run(make: Callable[[], StreamParser | None], pieces: list[str]) -> list[tuple]:
    parser = make()
    assert parser is not None
    parts = [part for piece in pieces for part in parser.feed(piece)]
    return normalise(parts + parser.finish())


def assert_any_split(
    make: Callable[[], StreamParser | None], text: str, expected: list[tuple]
) -> None:
    assert run(make, [text]) == expected
    assert run(make, list(text)) == expected
    for cut in range(len(text) + 1):
        assert run(make, [text[:cut], text[cut:]]) == expected, cut


def unchanged(text: str) -> tuple[str, list[tuple]]:
    """A case whose whole output is its input as text."""
    return text, [("text", text)] if text else []


def tool(name: str) -> Callable[[], StreamParser | None]:
    return lambda: make_tool_parser(name)


def think(starts_inside: bool) -> Callable[[], StreamParser | None]:
    return lambda: make_reasoning_parser("think", starts_inside)


WEATHER = {"city": "Paris", "unit": "°C"}
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n'
    "</tool_call>"
)

HERMES = [
    unchanged(""),
    unchanged("Hello there."),
    (
        f"Let me check. {HERMES_CALL} Done.",
        [("text", "Let me check. "), ("call", "get_weather", WEATHER), ("text", "Done.")],
    ),
    (
        f"{HERMES_CALL}\n{HERMES_CALL.replace('Paris', 'Oslo')}\n",
        [("call", "get_weather", WEATHER), ("call", "get_weather", {**WEATHER, "city": "Oslo"})],
    ),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', [("call", "f", {"a": 1})]),
    # Arguments first: judged when the object closes.
    ('<tool_call>{"arguments": {"a": [1]}, "name": "f"}</tool_call>', [("call", "f", {"a": [1]})]),
    (
        r'<tool_call>{"name": "f", "arguments": {"q": "a } \" { ]", "n": [1, {"b": null}]}}'
        "</tool_call>",
        [("call", "f", {"q": 'a } " { ]', "n": [1, {"b": None}]})],
    ),
    (r'<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>', [("call", "f", {"a": 1})]),
    # Not calls: the original text.
    unchanged('<tool_call>{"name": get_weather}</tool_call> x'),
    unchanged('<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    unchanged('<tool_call>{"name": "f"}</tool_call>'),
    unchanged("<tool_call>hello</tool_call>"),
    unchanged('Hi <tool_call>{"name": "get_wea'),
    unchanged("a <toolbox> b <tool_call"),
    # Cut off after the call started: it ends with the arguments it got.
    ('<tool_call>{"name": "f", "arguments": {"a": 1', [("call", "f", '{"a": 1')]),
    (
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> after',
        [("call", "f", {"a": 1}), ("text", "after")],
    ),
]

QWEN3_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    '<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{"metric": true}\n</parameter>\n'
    "</function>\n</tool_call>"
)
QWEN3 = [
    unchanged("Hello there."),
    (
        f"Checking.\n{QWEN3_CALL}\nDone.",
        [
            ("text", "Checking.\n"),
            ("call", "get_weather", {"city": "Paris", "days": 3, "opts": {"metric": True}}),
            ("text", "Done."),
        ],
    ),
    (
        f"{QWEN3_CALL}\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        [
            ("call", "get_weather", {"city": "Paris", "days": 3, "opts": {"metric": True}}),
            ("call", "now", {}),
        ],
    ),
    # Raw text stays a string, quotes and newlines included; a missing </parameter> is forgiven.
    (
        '<tool_call>\n<function=write>\n<parameter=text>\n"hi"\nline 2\n</parameter>\n'
        "<parameter=n>\nNaN\n</function>\n</tool_call>",
        [("call", "write", {"text": '"hi"\nline 2', "n": "NaN"})],
    ),
    unchanged('<tool_call>{"name": "x"}</tool_call>'),
    unchanged("<tool_call>\n<function=>\n"),
    unchanged("a <tool_call>\n<function=get_wea"),
    # Cut off inside a call: the complete parameters are kept.
    (
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nxy",
        [("call", "f", {"a": 1})],
    ),
]

LLAMA3 = [
    unchanged("Hello there."),
    unchanged("<b>bold</b>"),
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}',
        [("call", "get_weather", WEATHER)],
    ),
    (
        '\n{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1, 2]}}',
        [("call", "a", {}), ("call", "b", {"x": [1, 2]})],
    ),
    ('{"name": "a", "parameters": {}}\nDone.', [("call", "a", {}), ("text", "Done.")]),
    # JSON that is not a call, and text that merely contains a call, stay text.
    unchanged('{"answer": 42}'),
    unchanged('{"name": "Bob", "age": 3}'),
    unchanged('{"name": f, "parameters": {}}'),
    unchanged('Call {"name": "a", "parameters": {}}'),
    unchanged('<|python_tag|>{"name": "get_wea'),
    ('{"name": "f", "parameters": {"a": "b', [("call", "f", '{"a": "b')]),
]

MISTRAL = [
    unchanged("Hello there."),
    (
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}},'
        ' {"name": "now", "arguments": {}}] ok',
        [("text", "Sure. "), ("call", "get_weather", WEATHER), ("call", "now", {}), ("text", "ok")],
    ),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}[TOOL_CALLS]now[ARGS]{}',
        [("call", "get_weather", WEATHER), ("call", "now", {})],
    ),
    (
        '[TOOL_CALLS]a[ARGS]{"x": "[ARGS]"} b.c[ARGS] {"y": 1} The end.',
        [("call", "a", {"x": "[ARGS]"}), ("call", "b.c", {"y": 1}), ("text", "The end.")],
    ),
    unchanged("[TOOL_CALLS] not a call"),
    unchanged("[TOOL_CALLS]f[ARGS]oops"),
    unchanged('[TOOL_CALLS][{"name": 1}]'),
    unchanged("[TOOL_CALLS]get_wea"),
    unchanged("[TOOL_CALL]"),
    unchanged("[TOOL_CALLS][] no calls"),
    ('[TOOL_CALLS]f[ARGS]{"a": [1', [("call", "f", '{"a": [1')]),
]


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [("hermes", *case) for case in HERMES]
    + [("qwen3_coder", *case) for case in QWEN3]
    + [("llama3_json", *case) for case in LLAMA3]
    + [("mistral", *case) for case in MISTRAL],
)
def test_tool_parser_any_split(name, text, expected):
    assert_any_split(tool(name), text, expected)


THINK = [
    ("<think>\nHmm.\n</think>\n\nAnswer.", False, [("reasoning", "Hmm."), ("text", "Answer.")]),
    ("Hmm.\n</think>\n\nAnswer.", True, [("reasoning", "Hmm."), ("text", "Answer.")]),
    ("<think>Hmm.</think>Answer.", True, [("reasoning", "Hmm."), ("text", "Answer.")]),
    ("No thinking.", False, [("text", "No thinking.")]),
    ("<think>cut off", False, [("reasoning", "cut off")]),
    ("a <thinking> b", False, [("text", "a <thinking> b")]),
]


@pytest.mark.parametrize(("text", "inside", "expected"), THINK)
def test_reasoning_any_split(text, inside, expected):
    assert_any_split(think(inside), text, expected)


@pytest.mark.parametrize("inside", [False, True])
def test_reasoning_then_tool_calls(inside):
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    text = f"{'' if inside else '<think>'}Use f; not {call} here.</think>\n\nOK. {call}"
    expected = [
        ("reasoning", f"Use f; not {call} here."),
        ("text", "OK. "),
        ("call", "f", {"a": 1}),
    ]
    assert_any_split(lambda: compose(tool("hermes")(), think(inside)()), text, expected)


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "llama3_json", "mistral"])
def test_plain_text_streams_at_once(name):
    parser = compose(make_tool_parser(name), make_reasoning_parser("think"))
    assert parser.feed("Hello") == [TextPart("Hello")]
    assert parser.feed(", world") == [TextPart(", world")]
    assert parser.finish() == []


def test_possible_marker_is_held_back_then_released():
    parser = make_tool_parser("hermes")
    assert parser.feed("Hi <tool") == [TextPart("Hi ")]
    assert parser.feed("box>") == [TextPart("<toolbox>")]


def test_hermes_streams_arguments_before_the_call_closes():
    parser = make_tool_parser("hermes")
    assert parser.feed("<tool_call>\n") == []
    start, *rest = parser.feed('{"name": "get_weather", "arguments": {"city": "Pa')
    assert isinstance(start, ToolCallStart) and start.name == "get_weather"
    assert rest == [ToolCallArgs(0, '{"city": "Pa')]
    assert parser.feed('ris"}}') == [ToolCallArgs(0, 'ris"}'), ToolCallEnd(0)]
    assert parser.feed("\n</tool_call>") == []
    assert parser.finish() == []


def test_qwen3_coder_streams_each_parameter_as_it_completes():
    parser = make_tool_parser("qwen3_coder")
    assert [type(p) for p in parser.feed("<tool_call>\n<function=f>\n")] == [ToolCallStart]
    assert parser.feed("<parameter=a>\n1\n</parameter>\n") == [ToolCallArgs(0, '{"a": 1')]
    assert parser.feed("</function>") == [ToolCallArgs(0, "}"), ToolCallEnd(0)]


def test_indexes_count_per_parser_instance():
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for _ in range(2):
        parser = make_tool_parser("hermes")
        starts = [p for p in parser.feed(call * 2) if isinstance(p, ToolCallStart)]
        assert [s.index for s in starts] == [0, 1]
