"""Request validation and how a request's sampling settings combine with the model's defaults."""

import pytest
from pydantic import ValidationError

from mlxd.api.common.error_shapes import from_validation_error
from mlxd.api.common.generation import sampling_params
from mlxd.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from mlxd.config import SamplingDefaults

HI = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **fields})


def test_minimal_chat_request():
    request = chat()
    assert request.stream is False and request.stop is None and request.n == 1


def test_stop_string_becomes_a_list():
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", "b"]).stop == ["a", "b"]


def test_unknown_fields_are_ignored():
    assert chat(parallel_tool_calls=True, store=False).model == "m"


def test_list_content_parts_are_accepted():
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    )
    assert request.messages[0].content[0].type == "text"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"12": 200}}, "logit_bias"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias.not-a-token"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_bad_fields_name_the_field(fields, param):
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    error = from_validation_error(caught.value)
    assert error.status == 400
    assert error.param == param, error.message
    assert param.split(".")[0] in error.message


def test_missing_model_is_named():
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": HI})
    assert from_validation_error(caught.value).param == "model"


def test_completion_prompt_forms():
    def prompts(value):
        return CompletionRequest.model_validate({"model": "m", "prompt": value}).prompts()

    assert prompts("hello") == ["hello"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts(["only one"]) == ["only one"]
    assert prompts([[4, 5]]) == [[4, 5]]
    assert prompts(["two", "prompts"]) == ["two", "prompts"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (["x"] * 17, ["ok", ""]):
        with pytest.raises(ValidationError):
            prompts(bad)


def test_request_values_override_model_defaults():
    defaults = SamplingDefaults(temperature=0.3, top_p=0.9, top_k=40, presence_penalty=0.5)
    merged = sampling_params(defaults, temperature=0.0, top_k=None, seed=3)
    assert merged.temperature == 0.0  # an explicit 0 is not "unset"
    assert merged.top_p == 0.9 and merged.top_k == 40 and merged.presence_penalty == 0.5
    assert merged.seed == 3 and merged.top_logprobs is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"stop": ["x"] * 1_000_000}, "stop"),
        ({"stop": ["x" * 1_001]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 257}, "tools"),
        (
            {"response_format": {"type": "json_schema", "schema": {"d": "x" * 200_000}}},
            "response_format",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}] * 17}]},
            "images",
        ),
    ],
)
def test_every_generation_request_meets_the_caps(fields: dict, field: str):
    import pickle

    from mlxd.types import GenerationRequest, OverLimit

    with pytest.raises(OverLimit) as caught:
        GenerationRequest("r", "m", 4, **fields)
    assert caught.value.status == 400 and caught.value.param == field
    # Named in the caller's dialect, and whole after crossing the worker wire.
    renamed = pickle.loads(pickle.dumps(caught.value.named({"stop": "stop_sequences"})))
    assert renamed.param == ("stop_sequences" if field == "stop" else field)
    assert renamed.message.startswith(renamed.param)
