"""Where weights come from (local dir, .gguf, pkg://, hf://) and loading them into MLX."""

from mlxd.models.gguf import convert_gguf, gguf_tensor_name
from mlxd.models.loader import LoadedModel, load_llm
from mlxd.models.sources import resolve_source

__all__ = [
    "LoadedModel",
    "convert_gguf",
    "gguf_tensor_name",
    "load_llm",
    "resolve_source",
]
