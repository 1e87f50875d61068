"""Load an embedding model with mlx-embeddings and run it the way sentence-transformers would.

Pooling and normalisation follow the model's own sentence-transformers files (`modules.json`,
`1_Pooling/config.json`) when it has them; without them, mean pooling and L2 normalisation
(what `mlx_embeddings`' own `text_embeds` compute). Weights are cast like the LLM's
(`loader._target_dtype`: float32 on the CPU backend).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_embeddings.utils import load
from mlx_lm.utils import dequantize_model
from tokenizers import Tokenizer

from mlxd.accel import backend_name
from mlxd.errors import ModelLoadError
from mlxd.models.activations import use_rational_gelu
from mlxd.models.loader import (
    FLOAT_DTYPES,
    _stored_dtype,
    _target_dtype,
    check_model_dir,
    flat_parameters,
)

log = logging.getLogger("mlxd.models")

# sentence-transformers' pooling modes, in the order it concatenates them.
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")
_ST = "sentence_transformers.models."
# Modules that do not change the vectors (or that we apply ourselves).
_KNOWN_MODULES = {f"{_ST}Transformer", f"{_ST}Pooling", f"{_ST}Normalize"}
DEFAULT_MAX_LENGTH = 512


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...] = ("mean_tokens",)
    normalize: bool = True


def read_pooling(model_dir: Path) -> Pooling:
    """The model's sentence-transformers pooling, or mean + normalize when it declares none."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    unknown = [m["type"] for m in modules if m.get("type") not in _KNOWN_MODULES]
    if unknown:
        # A Dense or other projection we do not run would give silently wrong vectors.
        raise ValueError(f"sentence-transformers modules not supported: {', '.join(unknown)}")
    normalize = any(m["type"] == f"{_ST}Normalize" for m in modules)
    pooling = next((m for m in modules if m["type"] == f"{_ST}Pooling"), None)
    if pooling is None:
        return Pooling(normalize=normalize)
    config = json.loads((model_dir / pooling["path"] / "config.json").read_text())
    if config.get("pooling_mode_weightedmean_tokens"):
        raise ValueError("pooling mode weightedmean_tokens is not supported")
    modes = tuple(m for m in POOLING_MODES if config.get(f"pooling_mode_{m}"))
    return Pooling(modes or ("mean_tokens",), normalize)


def read_max_length(model_dir: Path, config: dict[str, Any], tokenizer_max: int | None) -> int:
    """Longest input in tokens: sentence-transformers' max_seq_length, else the tokenizer's
    and the position table's limits."""
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.exists():
        length = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(length, int) and length > 0:
            return length
    limits = [
        v
        for v in (tokenizer_max, config.get("max_position_embeddings"))
        if isinstance(v, int) and 0 < v < 1_000_000  # transformers' "no limit" is 1e30
    ]
    return min(limits, default=DEFAULT_MAX_LENGTH)


def pool(hidden: mx.array, mask: mx.array, pooling: Pooling) -> mx.array:
    """Pooled (and maybe normalised) vectors of a right-padded batch: (batch, dims) float32."""
    hidden = hidden.astype(mx.float32)
    weights = mask[..., None].astype(mx.float32)
    lengths = mx.maximum(weights.sum(axis=1), 1.0)
    parts = []
    for mode in pooling.modes:
        if mode == "cls_token":
            parts.append(hidden[:, 0])
        elif mode == "max_tokens":
            parts.append(mx.where(weights > 0, hidden, -mx.inf).max(axis=1))
        elif mode == "mean_tokens":
            parts.append((hidden * weights).sum(axis=1) / lengths)
        elif mode == "mean_sqrt_len_tokens":
            parts.append((hidden * weights).sum(axis=1) / mx.sqrt(lengths))
        elif mode == "lasttoken":
            last = mask.astype(mx.int32).sum(axis=1) - 1
            parts.append(mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    vectors = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if pooling.normalize:
        vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return vectors


@dataclass
class LoadedEmbedding:
    model: nn.Module
    tokenizer: Tokenizer  # no padding, no truncation: the engine decides both
    prefix: list[int]  # special tokens around one input (e.g. [CLS] … [SEP])
    suffix: list[int]
    pad_id: int
    max_length: int
    pooling: Pooling
    dimensions: int
    dtype: str
    nbytes: int

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        """Vectors of `batch` (token ids with special tokens) in one forward pass."""
        width = max(map(len, batch))
        ids = np.full((len(batch), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.int32)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        mask_mx = mx.array(mask)
        output = self.model(mx.array(ids), attention_mask=mask_mx)
        hidden = getattr(output, "last_hidden_state", None)
        # Models that only expose pooled vectors: take them as they come.
        vectors = output.text_embeds if hidden is None else pool(hidden, mask_mx, self.pooling)
        return np.array(vectors.astype(mx.float32), copy=False)


def _special_tokens(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """What the tokenizer puts before and after one sequence's own tokens."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def load_embedding(path: Path, *, dtype: str = "auto", model_name: str) -> LoadedEmbedding:
    """Load model and tokenizer from a resolved model dir; ModelLoadError names the model."""
    path = check_model_dir(path, dtype, model_name)
    try:
        pooling = read_pooling(path)
        model, wrapper = load(str(path), lazy=True)
        target = _target_dtype(dtype)
        if target is not None:
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
            model.set_dtype(FLOAT_DTYPES[target])
        mx.eval(model.parameters())
        if backend_name() == "cpu":
            use_rational_gelu(model)  # the CPU's erf is the encoder's bottleneck
        hf = getattr(wrapper, "_tokenizer", wrapper)
        # A copy: tokenizer.json may pin padding/truncation (MiniLM pads everything to 128).
        tokenizer = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        tokenizer.no_padding()
        tokenizer.no_truncation()
        prefix, suffix = _special_tokens(tokenizer)
        config = json.loads((path / "config.json").read_text())
        loaded = LoadedEmbedding(
            model=model,
            tokenizer=tokenizer,
            prefix=prefix,
            suffix=suffix,
            pad_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
            max_length=read_max_length(path, config, getattr(hf, "model_max_length", None)),
            pooling=pooling,
            dimensions=0,
            dtype=target or _stored_dtype(model),
            nbytes=sum(a.nbytes for _, a in flat_parameters(model)),
        )
        # One tiny pass: proves the model runs and tells its output size.
        loaded.dimensions = loaded.forward([[*prefix, *suffix] or [loaded.pad_id]]).shape[-1]
    except Exception as exc:  # mlx-embeddings raises whatever its parsers do
        raise ModelLoadError(
            f"model '{model_name}': cannot load {path} as an embedding model: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return loaded
