"""Chat rendering of a prefilled assistant turn and of system messages among the turns."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerFast

from mlxd.errors import InvalidRequest
from mlxd.worker.prompt import loaded_tool_format, render_chat
from tests.unit.test_gguf import CHATML, tiny_metadata

# Like Gemma's or Mistral's templates: a system message is allowed only first.
SYSTEM_FIRST_ONLY = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system messages must come first') }}{% endif %}"
    "{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def tokenizer(template: str) -> TokenizerWrapper:
    from mlxd.models.gguf import build_tokenizer

    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(tiny_metadata()))
    fast.chat_template = template
    return TokenizerWrapper(fast)


def render(template: str, messages: list[dict]) -> str:
    return render_chat(tokenizer(template), messages, None, "m", tokenize=False)


def test_prefilled_assistant_turn_is_continued():
    text = render(
        CHATML,
        [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital is", "prefix": True},
        ],
    )
    assert text.endswith("<|im_start|>assistant\nThe capital is")


def test_final_assistant_turn_without_prefix_opens_a_new_turn():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert render(CHATML, messages).endswith("Hello<|im_end|>\n<|im_start|>assistant\n")


def test_empty_prefill_opens_a_new_turn():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "prefix": True},
    ]
    assert render(CHATML, messages).endswith("Hi<|im_end|>\n<|im_start|>assistant\n")


def test_system_messages_stay_in_place_where_the_template_allows():
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "B"},
    ]
    text = render(CHATML, messages)
    assert text.index("system\nA") < text.index("user\nHi") < text.index("system\nB")


def test_system_messages_fold_into_the_first_when_the_template_objects():
    messages = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "B"},
    ]
    text = render(SYSTEM_FIRST_ONLY, messages)
    assert text.startswith("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nHi")


def test_a_template_error_that_folding_cannot_fix_is_reported():
    strict = "{{ raise_exception('no') }}"
    with pytest.raises(InvalidRequest, match="rejected the messages: no"):
        render(strict, [{"role": "user", "content": "Hi"}, {"role": "system", "content": "B"}])


def test_the_tool_format_mlx_lm_loaded_is_read_from_the_wrapper():
    from mlx_lm.tool_parsers import glm47

    fast = tokenizer(CHATML)
    assert loaded_tool_format(fast) is None
    with_parser = TokenizerWrapper(fast, tool_parser=glm47.parse_tool_call)
    assert loaded_tool_format(with_parser) == "glm47"
