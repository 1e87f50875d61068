import os
from pathlib import Path

import pytest

from mlxd import accel
from tests.conftest import NOT_APPLICABLE

AVX512_FLAGS = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}


def test_coretype_follows_cpu_flags():
    assert accel.openblas_coretype(AVX512_FLAGS) == "SkylakeX"
    assert accel.openblas_coretype({"avx", "avx2", "fma"}) == "Haswell"
    assert accel.openblas_coretype({"sse3"}) is None
    assert accel.openblas_coretype(set()) is None


def test_optimized_env_preloads_first_and_keeps_user_choices(monkeypatch):
    monkeypatch.setattr(accel, "find_optimized_blas", lambda: "/x/openblas-pthread/libblas.so.3")
    monkeypatch.setattr(accel, "cpu_flags", lambda: AVX512_FLAGS)
    env = accel.optimized_env({"LD_PRELOAD": "/other.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == "/x/openblas-pthread/libblas.so.3:/other.so"
    assert env["OPENBLAS_CORETYPE"] == "SkylakeX"
    assert env["PATH"] == "/bin"
    mine = accel.optimized_env({"OPENBLAS_CORETYPE": "Haswell"})
    assert mine["OPENBLAS_CORETYPE"] == "Haswell"
    # Already optimized: nothing changes, so mlxd does not re-execute itself.
    assert accel.optimized_env(env) == env


def test_optimized_env_without_a_blas_asks_for_huge_pages_only(monkeypatch):
    monkeypatch.setattr(accel, "find_optimized_blas", lambda: None)
    env = accel.optimized_env({"A": "1"})
    assert env == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert accel.optimized_env(env) == env


def test_huge_pages_join_the_users_tunables_and_keep_their_choice(monkeypatch):
    monkeypatch.setattr(accel, "find_optimized_blas", lambda: None)
    other = accel.optimized_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert accel.optimized_env(off) == off


def test_a_process_started_with_it_maps_huge_pages() -> None:
    # glibc takes the tunable at process start: a child's 64 MB MLX buffer (malloc'd) is then
    # held in 2 MB pages where the kernel lets madvise ask for them (without it: none here).
    import subprocess
    import sys

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[madvise]" not in thp.read_text():
        pytest.skip("not applicable here: the kernel gives huge pages to all memory or none")
    script = (
        "import mlx.core as mx; a = mx.ones((16 << 20,)); mx.eval(a); "
        "print(next(l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHuge')))"
    )

    def huge_kb(env: dict[str, str]) -> int:
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        )
        return int(run.stdout.split()[1])

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert huge_kb(accel.optimized_env(plain)) >= 32 << 10 > huge_kb(plain)


def test_the_blas_named_is_the_preloaded_one_not_numpys(tmp_path, monkeypatch):
    """numpy maps its own OpenBLAS beside the preload (symbols renamed: MLX cannot call it);
    here at a path that sorts before the preload's, as a venv under /check or /home does."""
    import numpy

    blas = accel.find_optimized_blas()
    if blas is None:
        pytest.skip("no optimized BLAS installed (the Makefile installs Debian's OpenBLAS)")
    numpys = sorted(Path(numpy.__file__).parent.parent.glob("numpy.libs/*openblas*.so"))
    assert numpys, "numpy's wheel bundles its OpenBLAS"
    beside = tmp_path / "numpy.libs" / numpys[0].name
    beside.parent.mkdir()
    beside.symlink_to(numpys[0])
    assert str(beside) < blas
    monkeypatch.setattr(accel, "mapped_libraries", lambda: {str(beside), blas})
    monkeypatch.setenv("LD_PRELOAD", blas)
    named = accel.loaded_blas()
    assert named.endswith(f"({blas})") or named == Path(blas).name
    monkeypatch.setenv("LD_PRELOAD", "")  # not preloaded, still the one with cblas_sgemm
    assert accel.loaded_blas() == named


def test_the_tests_run_on_the_blas_the_daemon_runs_on() -> None:
    """mlxd.testing.blas re-executed pytest with the preload and put back the environment it
    was started with, for the processes the tests start."""
    if accel.find_optimized_blas() is None:
        pytest.skip(f"{NOT_APPLICABLE} no optimized BLAS is installed")
    blas = accel.loaded_blas()
    assert "reference" not in blas and "not loaded" not in blas, blas
    assert "MLXD_TEST_ENV" not in os.environ
