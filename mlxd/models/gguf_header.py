"""A GGUF file's header — metadata and tensor infos, never tensor data — and what in it the
importer (models/gguf.py) cannot take.

`mlxd check` and the memory estimate read this before any load: a file of several gigabytes is
refused for an unsupported architecture, quant type or tokenizer in well under a second, and
sized without being read. `gguf.GGUFReader` (llama.cpp's own reader) memory-maps the file; only
the pages holding the header are ever touched.

The SUPPORTED_* sets below are what the importer converts; extend them with it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader

# `general.architecture` values the importer maps onto an mlx-lm model.
SUPPORTED_ARCHITECTURES = frozenset({"llama"})
# `tokenizer.ggml.model` values the importer rebuilds a tokenizer from.
SUPPORTED_TOKENIZERS = frozenset({"gpt2"})
# Tensor types the importer converts (GGML type names, as `gguf.GGMLQuantizationType`).
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"})


class GGUFHeaderError(ValueError):
    """Not a GGUF file, or one whose header is cut short or malformed."""


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    architecture: str | None
    tokenizer: str | None
    # Scalar metadata (strings and numbers); arrays such as the vocabulary are left out.
    metadata: dict[str, Any]
    # GGML type name → tensors of that type, and one example tensor name per type.
    tensor_types: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    tensor_bytes: int = 0  # the tensor data as stored
    parameters: int = 0  # elements over all tensors
    # Every tensor: (name, GGML type name, shape row-major as numpy has it, input dim last).
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...] = ()

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` from the metadata (e.g. "block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def problems(self) -> list[str]:
        """What the importer cannot take, one sentence each (empty: supported)."""
        problems = []
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            problems.append(
                f"architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        unsupported = sorted(t for t in self.tensor_types if t not in SUPPORTED_TENSOR_TYPES)
        if unsupported:
            found = ", ".join(
                f"{t} ({self.tensor_types[t]} tensors, e.g. {self.examples[t]})"
                for t in unsupported
            )
            problems.append(
                f"tensor type{'s' if len(unsupported) > 1 else ''} {found} not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_TENSOR_TYPES))})"
            )
        if self.tokenizer not in SUPPORTED_TOKENIZERS:
            problems.append(
                f"tokenizer model {self.tokenizer!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_TOKENIZERS))})"
            )
        return problems


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path`. Raises GGUFHeaderError for a file that is not
    one, OSError for one that cannot be opened."""
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, TypeError) as exc:  # bad magic, version, truncation
        raise GGUFHeaderError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata: dict[str, Any] = {}
    for name, reader_field in reader.fields.items():
        if reader_field.types and len(reader_field.types) == 1 and not name.startswith("GGUF."):
            metadata[name] = reader_field.contents()
    types: Counter[str] = Counter()
    examples: dict[str, str] = {}
    tensors = []
    stored = elements = 0
    for tensor in reader.tensors:
        kind = _type_name(tensor.tensor_type)
        # GGUF lists dimensions innermost first.
        tensors.append((tensor.name, kind, tuple(int(d) for d in reversed(tensor.shape))))
        types[kind] += 1
        examples.setdefault(kind, tensor.name)
        stored += int(tensor.n_bytes)
        elements += int(tensor.n_elements)
    return GGUFHeader(
        path=path,
        architecture=metadata.get("general.architecture"),
        tokenizer=metadata.get("tokenizer.ggml.model"),
        metadata=metadata,
        tensor_types=types,
        examples=examples,
        tensor_bytes=stored,
        parameters=elements,
        tensors=tuple(tensors),
    )


def _type_name(kind: int) -> str:
    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"
