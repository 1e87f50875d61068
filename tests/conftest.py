from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mlxd_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir per test session, so the demo GGUF is converted once."""
    return tmp_path_factory.mktemp("mlxd-cache")
