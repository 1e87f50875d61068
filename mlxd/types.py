"""The one internal request type and the one event stream every engine speaks.

Below every layer: the API dialects translate to `GenerationRequest` at the edge and render
`Event`s back; engines, schedulers and the worker transport all speak these and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mlxd.errors import InvalidRequest

FinishReason = Literal["stop", "length", "cancelled", "error"]

# Caps every request meets whatever its dialect: each is work done for every sequence at every
# token (stops), memory taken before the model sees it (images) or a grammar to compile.
MAX_STOPS = 64
MAX_STOP_CHARS = 1_000
MAX_IMAGES = 16
MAX_TOOLS = 256
MAX_TOOLS_BYTES = 512 * 1024  # as JSON; a large MCP tool set is a few tens of KiB
MAX_SCHEMA_BYTES = 128 * 1024
MAX_SEQUENCES = 64  # per HTTP request: OpenAI's `n` times its prompts
# Image parts as they reach the engine (Anthropic's image blocks are translated to these).
IMAGE_TYPES = ("image_url", "image")


class OverLimit(InvalidRequest):
    """A request beyond one of the caps above. `field` is the internal field's name; the
    dialect the request came in names it its own way (`named`)."""

    def __init__(self, field: str, problem: str, shown: str | None = None):
        shown = shown or field
        super().__init__(f"{shown}: {problem}", param=shown)
        self.field, self.problem, self.shown = field, problem, shown

    def __reduce__(self) -> tuple[Any, ...]:  # crosses the worker wire as a pickle
        return OverLimit, (self.field, self.problem, self.shown)

    def named(self, names: dict[str, str]) -> OverLimit:
        """The same refusal naming the field as the caller's dialect does."""
        return OverLimit(self.field, self.problem, names.get(self.field, self.shown))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    # How many of the latest tokens the repetition penalty looks at; None: all generated.
    repetition_context_size: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # None: no logprobs; 0: the sampled token's only; n: also the n most likely alternatives.
    top_logprobs: int | None = None


@dataclass
class GenerationRequest:
    """A dialect-neutral generation request. Exactly one of `messages` / `prompt` is set."""

    request_id: str
    model: str
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    stop: list[str] = field(default_factory=list)
    # OpenAI-shaped tools: {"type": "function", "function": {name, description, parameters}}.
    tools: list[dict[str, Any]] | None = None
    # None/"auto", "none", "required" (any tool) or {"name": ...} (that tool).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # None, {"type": "json_object"} or {"type": "json_schema", "schema": {...}}.
    response_format: dict[str, Any] | None = None
    # Lower runs after higher: interactive requests 0, message batches -1.
    priority: int = 0
    # Extra variables for the chat template (e.g. {"enable_thinking": False}): the model's
    # YAML `chat_template_kwargs` overlaid with the request's.
    chat_template_kwargs: dict[str, Any] | None = None
    # The LoRA adapter to run with, for a model that shares its base's engine (set by its
    # view, runtime/shared_pool.py; the engine's key for the attached adapter). None: the base.
    adapter: str | None = None
    # The prefix-cache partition (a salted digest of the caller's API key, never the key; ""
    # on an open daemon): cached prompts are shared only within one.
    cache_scope: str = ""

    def __post_init__(self) -> None:
        # Here, not in each dialect: every way of building a request meets the same caps.
        _check_stops(self.stop)
        _check_images(self.messages or [])
        _check_tools(self.tools or [])
        schema = (self.response_format or {}).get("schema")
        if schema is not None and _json_size(schema) > MAX_SCHEMA_BYTES:
            raise OverLimit("response_format", f"the schema is over {MAX_SCHEMA_BYTES} bytes")


def _check_stops(stops: list[str]) -> None:
    if len(stops) > MAX_STOPS:
        raise OverLimit("stop", f"at most {MAX_STOPS} stop sequences (got {len(stops)})")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise OverLimit("stop", f"each stop sequence is at most {MAX_STOP_CHARS} characters")


def image_parts(messages: Iterable[dict[str, Any]]) -> Iterable[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, part) of each image in `messages`, in prompt order."""
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                yield i, j, part


def _check_images(messages: list[dict[str, Any]]) -> None:
    count = sum(1 for _ in image_parts(messages))
    if count > MAX_IMAGES:
        raise OverLimit("images", f"at most {MAX_IMAGES} images per request (got {count})")


def _check_tools(tools: list[dict[str, Any]]) -> None:
    if len(tools) > MAX_TOOLS:
        raise OverLimit("tools", f"at most {MAX_TOOLS} tools (got {len(tools)})")
    if tools and _json_size(tools) > MAX_TOOLS_BYTES:
        raise OverLimit("tools", f"the tool definitions are over {MAX_TOOLS_BYTES} bytes")


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


# Arguments of `apply_chat_template` itself: chat_template_kwargs may not set them (they
# would change how mlxd renders, not what the template sees).
RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class Delta:
    """New text from one sequence; `text` may be empty when a stop string is still undecided."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None
    error: str | None = None
    # The HTTP status an error maps to: 500 for a failed generation, 503 when the model's
    # worker died under the request (it is being restarted: retrying later works).
    error_status: int = 500


Event = Delta | Finished


@dataclass(frozen=True)
class Admission:
    """What preparing a request found out, known before its first event: what the API side
    needs to read and announce the response without rendering the prompt again."""

    prompt_tokens: int
    # The output calls tools in Hermes syntax whatever the model's own format: mlxd prompted
    # them that way (a template without tool support) or a grammar forces the call.
    hermes_tools: bool = False
    # The prompt already opened a reasoning block (`<think>` at its end): output starts inside.
    reasoning_open: bool = False


EmbeddingInput = list[str] | list[list[int]]


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # (inputs, dimensions) float32
    prompt_tokens: int  # every token the model read, special tokens included


@dataclass(frozen=True)
class TranscriptionRequest:
    """One clip to transcribe (or translate into English): mono float32 at the model's rate."""

    samples: np.ndarray
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = None  # ISO-639-1; None detects it
    prompt: str | None = None  # earlier text the first window continues
    temperature: float = 0.0  # 0: greedy, falling back to hotter samples on failure
    word_timestamps: bool = False


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Segment:
    id: int
    seek: int  # where its 30 s window starts, in 10 ms mel frames (Whisper's count)
    start: float  # seconds from the start of the clip
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


@dataclass(frozen=True)
class Transcript:
    text: str
    language: str
    duration: float  # seconds of audio
    segments: list[Segment]
    words: list[Word]


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str
    speed: float = 1.0


@dataclass(frozen=True)
class Speech:
    samples: np.ndarray  # mono float32
    sample_rate: int
