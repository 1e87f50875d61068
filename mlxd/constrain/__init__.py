"""Constrained decoding: JSON, JSON schema and forced tool calls through llguidance."""

from mlxd.constrain.grammar import TOOL_CALL_FORMATS, Constrainer
from mlxd.constrain.processor import GrammarProcessor, make_processor

__all__ = ["TOOL_CALL_FORMATS", "Constrainer", "GrammarProcessor", "make_processor"]
