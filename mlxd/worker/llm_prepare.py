"""Preparing a request for a text LLM, once and off the event loop: the prompt's token ids
(the chat template for messages), its grammar and test-hook processors (structured output),
the `Admission` the API side reads, and the check of the prompt against the context.

`LLMEngine` (worker/llm.py) inherits it; `VLMEngine` overrides `encode` and `prepare` for
prompts with images."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from mlxd.config import ModelConfig
from mlxd.constrain import Constrainer, GrammarProcessor, make_processor
from mlxd.errors import InvalidRequest
from mlxd.parsers.reasoning import prompt_opens_reasoning
from mlxd.types import Admission, GenerationRequest
from mlxd.worker.hooks import WorkerHooks
from mlxd.worker.prompt import render_chat, template_supports_tools
from mlxd.worker.sequence import MediaPrefill


@dataclass
class Prepared:
    """Everything a request needs from its model before it can queue, worked out once, off
    the event loop: the prompt, its processors, its media prefill and its `Admission`."""

    prompt_ids: list[int]
    processors: list[GrammarProcessor]
    admission: Admission
    prefill: MediaPrefill | None = None


class RequestPreparation:
    """The engine's `prepare()` and what it takes: the engine sets these attributes."""

    name: str
    config: ModelConfig
    tokenizer: Any
    context_length: int
    chat_template: str | None
    _hooks: WorkerHooks
    _constrainer_instance: Constrainer | None
    _constrainer_lock: threading.Lock

    def prepare(self, request: GenerationRequest) -> Prepared:
        """The prompt ids, the sequence's grammar processor, and what the API side needs to
        know; blocking (templates, tokenizing, grammars can take a while)."""
        prompt_ids = self.encode(request)
        return Prepared(
            prompt_ids, self.request_processors(request), self._admission(request, prompt_ids)
        )

    def _admission(self, request: GenerationRequest, prompt_ids: list[int]) -> Admission:
        forced = request.tool_choice not in (None, "auto")
        return Admission(
            prompt_tokens=len(prompt_ids),
            # Forced calls are generated in Hermes syntax by the grammar; so are calls of a
            # template that cannot render tools (mlxd prompts those in Hermes style).
            hermes_tools=bool(request.tools)
            and (forced or not template_supports_tools(self.chat_template)),
            reasoning_open=prompt_opens_reasoning(self.tokenizer.decode(prompt_ids[-4:])),
        )

    def request_processors(self, request: GenerationRequest) -> list[GrammarProcessor]:
        """The grammar and test-hook processors of a request (followers of a distributed
        model build theirs with it too)."""
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in request.sampling.logit_bias or {}):
            # mlx indexes logits without bounds checks: a stray id corrupts memory.
            message = f"logit_bias token ids must be in [0, {vocab})"
            raise InvalidRequest(message, param="logit_bias")
        try:
            grammar = self._grammar(request)
            processors = (
                []
                if grammar is None
                else [make_processor(self._constrainer(), grammar, self.tokenizer.eos_token_ids)]
            )
        except ValueError as exc:  # llguidance's message for a bad schema or grammar
            param = "tool_choice" if request.tools else "response_format"
            raise InvalidRequest(f"cannot constrain the output: {exc}", param=param) from exc
        return processors + self._hooks.logits_processors(request)

    def _grammar(self, request: GenerationRequest) -> str | None:
        """One mechanism for structured output: forced tool calls and response_format."""
        choice = request.tool_choice
        if request.tools and (choice == "required" or isinstance(choice, dict)):
            name = choice.get("name") if isinstance(choice, dict) else None
            # Exactly one call: "required" is met by one, and small models given the
            # option tend to repeat calls until max_tokens.
            return self._constrainer().tool_call(request.tools, name)
        response_format = request.response_format or {}
        if response_format.get("type") == "json_object":
            return self._constrainer().json_object()
        if response_format.get("type") == "json_schema":
            return self._constrainer().json_schema(response_format["schema"])
        return None

    def _constrainer(self) -> Constrainer:
        # Built on first use (≈0.4 s): most models never see a structured-output request.
        with self._constrainer_lock:
            if self._constrainer_instance is None:
                self._constrainer_instance = Constrainer(self.tokenizer)
            return self._constrainer_instance

    def encode(self, request: GenerationRequest) -> list[int]:
        """Token ids of the prompt: the chat template for messages, plain encoding otherwise."""
        if request.messages is not None:
            ids = render_chat(
                self.tokenizer,
                request.messages,
                request.tools,
                self.name,
                template_kwargs=request.chat_template_kwargs,
            )
        elif isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt or [])
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        return ids

    def _admissible_max_tokens(self, request: GenerationRequest, prepared: Prepared) -> int:
        prompt_ids = prepared.prompt_ids
        limit = self.config.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise InvalidRequest(
                f"prompt is {len(prompt_ids)} tokens; model '{self.name}' accepts at most "
                f"{limit} (max_prompt_tokens)",
                param="messages" if request.messages is not None else "prompt",
            )
        room = self.context_length - len(prompt_ids)
        if room <= 0:
            raise InvalidRequest(
                f"prompt is {len(prompt_ids)} tokens; model '{self.name}' has a context of "
                f"{self.context_length} tokens",
                param="messages" if request.messages is not None else "prompt",
            )
        return min(request.max_tokens, room)
