from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mlxd_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir per test session, so the demo GGUF is converted once."""
    return tmp_path_factory.mktemp("mlxd-cache")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> Path:
    """A tiny random-weight Qwen2-VL model directory (see tests/tiny_vlm.py)."""
    from tests.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), mlxd_cache_dir)
