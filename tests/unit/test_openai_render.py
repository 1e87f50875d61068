"""How parsed parts become OpenAI chat chunks: content, reasoning, tool calls, finish."""

from mlxd.api.common.parts import Logprobs
from mlxd.api.openai.chat import _chat_choices
from mlxd.parsers.base import ReasoningPart, TextPart, ToolCallArgs, ToolCallEnd, ToolCallStart
from mlxd.types import Finished, TokenLogprob


def test_reasoning_text_and_tool_call_deltas():
    choice = _chat_choices()
    # Both names clients read reasoning under.
    assert choice(ReasoningPart("hmm"))["delta"] == {"reasoning_content": "hmm", "reasoning": "hmm"}
    assert choice(TextPart("Let me check."))["delta"] == {"content": "Let me check."}
    start = choice(ToolCallStart(0, "call_1", "get_weather"))["delta"]["tool_calls"][0]
    assert start == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    args = choice(ToolCallArgs(0, '{"city": "Paris"}'))["delta"]["tool_calls"][0]
    assert args == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert choice(ToolCallEnd(0)) is None
    assert choice(Finished("stop", 10, 5))["finish_reason"] == "tool_calls"


def test_finish_reason_without_tool_calls_and_on_length():
    assert _chat_choices()(Finished("stop", 1, 1))["finish_reason"] == "stop"
    choice = _chat_choices()
    choice(ToolCallStart(0, "c", "f"))
    assert choice(Finished("length", 1, 1))["finish_reason"] == "length"


def test_logprobs_ride_in_their_own_chunk():
    rendered = _chat_choices()(Logprobs([TokenLogprob("Hi", -0.1, [("Hi", -0.1)])]))
    assert rendered["delta"] == {}
    assert rendered["logprobs"]["content"][0]["token"] == "Hi"
