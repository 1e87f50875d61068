"""mlx-lm's tool-call formats through mlxd's streaming layer, and the reasoning parser names:
whole text, split in two at every position, and one char at a time give the same parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.parsers.registry import (
    detect_tool_format,
    make_reasoning_parser,
    make_tool_parser,
)
from tests.unit.test_parsers import assert_any_split, run

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
PARIS = ("call", "get_weather", {"city": "Paris", "days": 2})
ROME = ("call", "get_weather", {"city": "Rome", "days": 1})

CASES = {
    "gemma4": (
        'Sure. <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|> done',
        [("text", "Sure. "), PARIS, ("text", "done")],
    ),
    "function_gemma": (
        "Ok <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:2}"
        "<end_function_call>",
        [("text", "Ok "), PARIS],
    ),
    "glm47": (
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        [("text", "Let me check."), PARIS],
    ),
    "kimi_k2": (
        "x <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_weather:1"
        '<|tool_call_argument_begin|>{"city": "Rome", "days": 1}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        [("text", "x "), PARIS, ROME],
    ),
    "minimax_m2": (
        'Checking.<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris'
        '</parameter><parameter name="days">2</parameter></invoke></minimax:tool_call>',
        [("text", "Checking."), PARIS],
    ),
    "pythonic": (
        'Hi <|tool_call_start|>[get_weather(city="Paris", days=2)]<|tool_call_end|> bye',
        [("text", "Hi "), PARIS, ("text", "bye")],
    ),
    "longcat": (
        "<longcat_tool_call>get_weather<longcat_arg_key>city</longcat_arg_key>"
        "<longcat_arg_value>Paris</longcat_arg_value><longcat_arg_key>days</longcat_arg_key>"
        "<longcat_arg_value>2</longcat_arg_value></longcat_tool_call>",
        [PARIS],
    ),
    "minicpm5": (
        '<function name="get_weather"><param name="city">Paris</param>'
        '<param name="days">2</param></function>',
        [PARIS],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_split_gives_the_same_calls(name: str) -> None:
    text, expected = CASES[name]
    assert_any_split(lambda: make_tool_parser(name, None, TOOLS), text, expected)


@pytest.mark.parametrize(("alias", "name"), [("gemma", "gemma4"), ("kimi", "kimi_k2")])
def test_short_names_reach_the_same_format(alias: str, name: str) -> None:
    text, expected = CASES[name]
    assert run(lambda: make_tool_parser(alias, None, TOOLS), [text]) == expected


def test_a_block_mlx_lm_cannot_read_stays_text() -> None:
    text = "<|tool_call_start|>not a call at all<|tool_call_end|> ok"
    assert_any_split(lambda: make_tool_parser("pythonic"), text, [("text", text)])


def test_a_block_cut_by_the_end_of_generation_is_still_read() -> None:
    # The end marker is often a special token that stops generation before it is written.
    text = 'Hi <|tool_call_start|>[get_weather(city="Paris", days=2)]'
    assert_any_split(lambda: make_tool_parser("pythonic"), text, [("text", "Hi "), PARIS])


def test_text_without_markers_streams_through() -> None:
    parser = make_tool_parser("minimax_m2")
    assert parser is not None
    assert [p.text for p in parser.feed("Hello <mini")] == ["Hello "]  # marker prefix held
    assert [p.text for p in parser.feed("mal> world") + parser.finish()] == ["<minimal> world"]


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{{ '<tool_call>' + tc.name + '<arg_key>' }}", "glm47"),
        ("{{ '<minimax:tool_call>' }}", "minimax_m2"),
        ("{{ '<|tool_call>' }}call:{{ '<tool_call|>' }}", "gemma4"),
        ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
        ("<|tool_list_start|>{{ tools }}<|tool_list_end|>", "pythonic"),
        ("<tool_call>{{ tool_call.name }}</tool_call>", "hermes"),  # mlx-lm's json_tools
    ],
)
def test_auto_recognises_the_mlx_lm_formats(template: str, name: str, tmp_path: Path) -> None:
    """The format mlx-lm's tokenizer loader infers from the template, read from its wrapper
    as the worker reads it (worker.prompt.loaded_tool_format)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import PreTrainedTokenizerFast

    from mlxd.models.gguf import build_tokenizer
    from mlxd.worker.prompt import loaded_tool_format
    from tests.unit.test_gguf import tiny_metadata

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(tiny_metadata()))
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    loaded = loaded_tool_format(load_tokenizer(tmp_path))
    assert detect_tool_format(template, loaded) == name


THINKING = "<think>Paris is in France.</think>The capital is Paris."


@pytest.mark.parametrize("name", ["think", "qwen3", "deepseek_r1"])
def test_reasoning_names_split_the_think_block(name: str) -> None:
    expected = [("reasoning", "Paris is in France."), ("text", "The capital is Paris.")]
    assert_any_split(lambda: make_reasoning_parser(name), THINKING, expected)


def test_deepseek_r1_reads_a_block_its_prompt_opened() -> None:
    text = "Paris is in France.</think>The capital is Paris."
    expected = [("reasoning", "Paris is in France."), ("text", "The capital is Paris.")]
    assert_any_split(lambda: make_reasoning_parser("deepseek_r1"), text, expected)


HARMONY = (
    "<|channel|>analysis<|message|>The user asks for the capital. It is Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>"
)


def test_gpt_oss_channels_become_reasoning_and_text() -> None:
    expected = [
        ("reasoning", "The user asks for the capital. It is Paris."),
        ("text", "The capital of France is Paris."),
    ]
    assert_any_split(lambda: make_reasoning_parser("gpt_oss"), HARMONY, expected)


def test_gpt_oss_without_channels_is_text() -> None:
    assert_any_split(
        lambda: make_reasoning_parser("gpt_oss"), "Just text.", [("text", "Just text.")]
    )


def test_gpt_oss_commentary_preamble_is_text() -> None:
    text = (
        "<|channel|>commentary<|message|>Let me look that up.<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Think.<|end|>"
    )
    expected = [("text", "Let me look that up."), ("reasoning", "Think.")]
    assert_any_split(lambda: make_reasoning_parser("gpt_oss"), text, expected)
