"""What loading a text LLM takes beside its weights: the speculative draft model, checked
against the target, and the identity the model's KV cache is keyed by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from mlxd.config import ModelConfig, SpeculativeConfig
from mlxd.errors import ModelLoadError
from mlxd.models.loader import LoadedModel, load_llm
from mlxd.worker.factory import resolve_draft


def load_draft(
    name: str,
    speculative: SpeculativeConfig,
    target: LoadedModel,
    cache_dir: Path,
    kv_dtype: str = "auto",
) -> LoadedModel:
    """Speculative mode draft's model, checked to share the target's vocabulary and to have
    caches that can be trimmed back after a rejected draft."""
    weights = speculative.draft
    if weights is None:  # a config built without its file's Config
        raise ModelLoadError(f"model '{name}': speculative.model was not resolved")
    draft = load_llm(
        resolve_draft(weights, cache_dir), dtype=weights.dtype, model_name=name, kv_dtype=kv_dtype
    )
    vocab, draft_vocab = target.config.get("vocab_size"), draft.config.get("vocab_size")
    if vocab != draft_vocab:
        raise ModelLoadError(
            f"model '{name}': draft model '{weights.name}' has a vocabulary of {draft_vocab} "
            f"tokens, this model {vocab}: a draft must share the tokenizer"
        )
    if not can_trim_prompt_cache(make_prompt_cache(draft.model)):
        raise ModelLoadError(
            f"model '{name}': draft model '{weights.name}' has caches that cannot be trimmed "
            "(sliding-window attention); pick another draft"
        )
    return draft


def kv_identity(config: ModelConfig, loaded: LoadedModel) -> dict[str, Any]:
    """What makes this model's KV what it is: its source, weight files, compute dtype and
    adapter (no key without one, so a base model's SSD blocks stay valid), and the KV's dtype
    where it is not the compute dtype (a float16 cache: never mixed with float32 blocks), and
    the int8 dot products' rounding of x where the layers run them (cpu_activations: other
    numbers; the output head's layout writes no KV, so it is not part of it)."""
    identity: dict[str, Any] = {
        "source": config.source,
        "path": str(loaded.path),
        "weights": _file_stamps(loaded.path),
        "dtype": loaded.dtype,
        "model": loaded.config,
    }
    if loaded.kv_dtype == "float16" and loaded.dtype != "float16":
        identity["kv_dtype"] = loaded.kv_dtype
    if loaded.cpu_path is not None and loaded.cpu_path.dot:
        identity["activations"] = loaded.cpu_path.activations
    if config.adapter is not None:
        identity["adapter"] = {"path": str(config.adapter), "files": _file_stamps(config.adapter)}
    return identity


def _file_stamps(directory: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in directory.glob("*.safetensors")
    )
