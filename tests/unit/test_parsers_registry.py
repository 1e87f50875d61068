"""Parser names, picking a format from a chat template, and chaining reasoning + tools."""

import pytest

from mlxd.parsers import (
    compose,
    detect_tool_format,
    make_reasoning_parser,
    make_tool_parser,
    prompt_opens_reasoning,
)
from mlxd.parsers.base import ReasoningPart, TextPart
from mlxd.parsers.hermes import HermesParser
from mlxd.parsers.llama3_json import Llama3JsonParser
from mlxd.parsers.mistral import MistralParser
from mlxd.parsers.qwen3_coder import Qwen3CoderParser
from mlxd.parsers.reasoning import ThinkParser

# Just enough of each family's chat template to recognise it.
QWEN25 = (
    "{%- if tools %}For each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>{%- endif %}'
)
QWEN3_CODER = (
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}"
)
MISTRAL = "{%- if message.tool_calls %}{{- '[TOOL_CALLS]' }}{%- endif %}"
LLAMA31 = "{{- '<|python_tag|>' + tool_call.name + '.call(' }}"
LLAMA32 = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}. Do not use variables.' }}"
)
PLAIN = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "name", "kind"),
    [
        (QWEN25, "hermes", HermesParser),
        (QWEN3_CODER, "qwen3_coder", Qwen3CoderParser),
        (MISTRAL, "mistral", MistralParser),
        (LLAMA31, "llama3_json", Llama3JsonParser),
        (LLAMA32, "llama3_json", Llama3JsonParser),
    ],
)
def test_auto_picks_the_format_from_the_template(template, name, kind):
    assert detect_tool_format(template) == name
    assert type(make_tool_parser("auto", template)) is kind


@pytest.mark.parametrize("template", [PLAIN, None])
def test_auto_without_a_known_format_gives_no_parser(template):
    assert make_tool_parser("auto", template) is None


def test_names():
    assert type(make_tool_parser("qwen")) is HermesParser
    assert type(make_tool_parser("hermes", PLAIN)) is HermesParser  # a name beats the template
    assert make_tool_parser(None, QWEN25) is None
    assert make_tool_parser("hermes") is not make_tool_parser("hermes")  # state is per response
    assert type(make_reasoning_parser("think")) is ThinkParser
    assert make_reasoning_parser(None) is None


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"'hermez'.*valid: auto, hermes, qwen, qwen3_coder"):
        make_tool_parser("hermez")
    with pytest.raises(ValueError, match="valid: think"):
        make_reasoning_parser("thonk")


def test_compose_without_parsers_passes_text_through():
    parser = compose(None, None)
    assert parser.feed("<tool_call><think>") == [TextPart("<tool_call><think>")]
    assert parser.feed("") == []
    assert parser.finish() == []


def test_compose_with_one_parser_is_that_parser():
    tool, reasoning = make_tool_parser("hermes"), make_reasoning_parser("think")
    assert compose(tool, None) is tool
    assert compose(None, reasoning) is reasoning


def test_reasoning_streams_before_the_block_closes():
    parser = compose(make_tool_parser("hermes"), make_reasoning_parser("think", starts_inside=True))
    assert parser.feed("Let me") == [ReasoningPart("Let me")]
    assert parser.feed(" think.</th") == [ReasoningPart(" think.")]
    assert parser.feed("ink>\n\nHi") == [TextPart("Hi")]


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_reasoning(prompt, opens):
    assert prompt_opens_reasoning(prompt) is opens


@pytest.mark.parametrize(
    ("loaded", "template", "name"),
    [
        ("glm47", PLAIN, "glm47"),  # mlx-lm's loader knows formats mlxd's checks do not
        ("json_tools", PLAIN, "hermes"),  # mlx-lm's names for mlxd's own parsers
        ("qwen3_coder", QWEN25, "qwen3_coder"),  # the loader's finding beats the template's
        (None, QWEN25, "hermes"),
    ],
)
def test_the_format_mlx_lm_loaded_comes_first(loaded, template, name):
    assert detect_tool_format(template, loaded) == name
