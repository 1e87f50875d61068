"""Grammars for constrained decoding, written for llguidance against one model's tokenizer.

The methods return llguidance grammar strings; `make_processor` compiles one into a matcher per
sequence (that is where an invalid schema surfaces, as ValueError).
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance import LLMatcher
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

# JSON as `json.dumps` writes it, on one line. With llguidance's default (any whitespace between
# tokens) small models can emit newlines or spaces until max_tokens instead of closing the object.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Client tool schemas are documentation first: enforce what llguidance can, ignore the rest
# (e.g. an unsupported `format`) rather than refusing a forced tool call.
TOOL_ARGUMENT_OPTIONS: JsonCompileOptions = {**JSON_OPTIONS, "lenient": True}

TOOL_CALL_FORMATS = ("hermes",)


class Constrainer:
    """Per-engine grammar factory; holds the llguidance tokenizer (≈0.4 s to build, so once)."""

    def __init__(self, tokenizer: TokenizerWrapper | PreTrainedTokenizerFast):
        if isinstance(tokenizer, TokenizerWrapper):
            eos = sorted(tokenizer.eos_token_ids)
        else:
            eos = [tokenizer.eos_token_id]
        # The Rust tokenizer (mlx-lm's wrapper forwards attributes to the HF tokenizer), as
        # llguidance.hf.from_tokenizer serialises it, which accepts the HF class alone.
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)

    def json_object(self) -> str:
        """Any JSON object."""
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)

    def json_schema(self, schema: dict[str, Any]) -> str:
        """JSON valid under `schema`; keywords llguidance cannot enforce are an error."""
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(
            schema, overrides={**JSON_OPTIONS, "lenient": False}
        )

    def tool_call(
        self,
        tools: list[dict[str, Any]],
        name: str | None = None,
        format: str = "hermes",
        parallel: bool = False,
    ) -> str:
        """A call of one of `tools` (or of the tool `name`) in the model's tool-call syntax.

        `tools` are OpenAI-style {"type": "function", "function": {"name", "parameters"}}.
        `parallel` allows further calls after the first, as the format separates them.
        """
        if format not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"tool-call format {format!r} cannot be constrained "
                f"(supported: {', '.join(TOOL_CALL_FORMATS)})"
            )
        functions = _functions(tools)
        if name is not None:
            if name not in functions:
                raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
            functions = {name: functions[name]}
        # The envelope is literal text; each tool's arguments are a grammar of their own, so
        # that "$ref"s in its parameters resolve against the parameters schema.
        alternatives = []
        for i, fn_name in enumerate(functions):
            prefix = json.dumps(fn_name, ensure_ascii=False) + ', "arguments": '
            alternatives.append(f"{_lark_string(prefix)} @args_{i}")
        head = _lark_string('\n{"name": ')
        tail = _lark_string("}\n")
        open_tag, close_tag = self._literal("<tool_call>"), self._literal("</tool_call>")
        lark = "\n".join(
            [
                'start: call ("\\n" call)*' if parallel else "start: call",
                f"call: {open_tag} {head} ({' | '.join(alternatives)}) {tail} {close_tag}",
            ]
        )
        arguments = [
            {
                "name": f"args_{i}",
                "json_schema": {**parameters, "x-guidance": TOOL_ARGUMENT_OPTIONS},
            }
            for i, parameters in enumerate(functions.values())
        ]
        return json.dumps({"grammars": [{"lark_grammar": lark}, *arguments]})

    def _literal(self, text: str) -> str:
        """`text` as a Lark grammar element: a special token where the tokenizer has one.

        Special tokens never match quoted text in llguidance, so a model whose tokenizer has
        `<tool_call>` as a special token could not emit it as a string literal.
        """
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return _lark_string(text)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tool name → parameters schema (any object when a tool declares none)."""
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            function = {}  # no name: rejected below
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("every tool needs a function with a name")
        parameters = function.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
        functions[name] = parameters
    if not functions:
        raise ValueError("a constrained tool call needs at least one tool")
    return functions
