"""Where MLX computes: the backend (cpu/metal/cuda) and, on the CPU, the BLAS behind matmuls.

The Linux MLX CPU wheel bundles the reference BLAS (≈4 GFLOP/s). Preloading an optimized
libblas.so.3 (Debian's OpenBLAS) interposes `cblas_sgemm` & co. A preload only works from
process start, so mlxd re-executes itself once with LD_PRELOAD set.

Debian's OpenBLAS 0.3.21 also takes CPUs it does not recognise (virtualized Xeons report a
generic model) for a 2004 "Prescott" and runs SSE3 kernels: measured here, 39 GFLOP/s for a
1280x576x1536 sgemm against 184 GFLOP/s with OPENBLAS_CORETYPE=SkylakeX. So the re-exec also
names the kernel family the CPU's flags support, unless the user already chose one.

It also asks glibc (2.35 and later) for transparent huge pages on the memory it maps, MLX's
buffers included (`glibc.malloc.hugetlb=1`; the kernel's THP mode is `madvise` on Debian, so
without the request every weight is read through 4 KB pages): a decode step reads every weight
once, and with 2 MB pages SmolLM2's one-row forward pass took 4.9-5.1 ms instead of 5.2-5.9, 8
rows 14.6-15.4 instead of 15.3-18.6, a Llama-3.2-1B shape's one row 17.9-19.2 instead of
20.7-22.8 (in one process, alternated runs, AMD EPYC Zen 5), at the same resident size. A
tunable the user set is kept.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from pathlib import Path

# Checked in order; the first that exists is preloaded.
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/blis-pthread/libblas.so.3",
)
OPTIMIZED_MARKERS = ("openblas", "blis", "mkl")
# Set in the re-executed child so a failed preload can never loop.
REEXEC_GUARD = "MLXD_BLAS_REEXEC"
AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
HUGE_PAGES = ("glibc.malloc.hugetlb", "1")


def find_optimized_blas() -> str | None:
    return next((path for path in CANDIDATES if Path(path).exists()), None)


def cpu_flags() -> set[str]:
    """The CPU's feature flags: x86's `flags` line of /proc/cpuinfo, aarch64's `Features`."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def openblas_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family for these x86 CPU flags (None: let OpenBLAS decide)."""
    if flags >= AVX512:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def optimized_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus what makes MLX's CPU work fast here: huge pages, the BLAS preload and its
    kernels."""
    env = dict(env)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    name, value = HUGE_PAGES
    if not any(t.split("=")[0] == name for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{name}={value}"])
    blas = find_optimized_blas()
    if blas is None:
        return env
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if blas not in preload:
        env["LD_PRELOAD"] = ":".join([blas, *preload])
    coretype = openblas_coretype(cpu_flags()) if "openblas" in blas else None
    if coretype and "OPENBLAS_CORETYPE" not in env:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


def ensure_optimized_blas(module: str = "mlxd") -> None:
    """Re-exec the current command as `python -m module` with `optimized_env()` when it
    differs from ours.

    Does nothing off Linux, when nothing would change, or inside the re-executed child.
    """
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_GUARD):
        return
    env = optimized_env(os.environ)
    if env == dict(os.environ):
        return
    env[REEXEC_GUARD] = "1"
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def loaded_blas() -> str:
    """Name the BLAS this process has mapped: an optimized one, MLX's bundled reference, or none."""
    libs = mapped_libraries()
    if libs is None:
        return "platform default"  # macOS: MLX uses Accelerate
    # The preloaded library answers MLX's cblas calls first; others may be mapped beside it
    # without serving MLX (numpy's bundled OpenBLAS renames its symbols).
    preloaded = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if lib in libs]
    for lib in [*preloaded, *sorted(libs)]:
        if not any(marker in lib.lower() for marker in OPTIMIZED_MARKERS) or not _has_cblas(lib):
            continue
        if "openblas" in lib.lower():
            return f"OpenBLAS {_openblas_core(lib)} ({lib})"
        return Path(lib).name
    if any("libblas" in lib for lib in libs):
        return "reference BLAS (slow)"
    return "not loaded yet"


def mapped_libraries() -> set[str] | None:
    """The shared libraries this process has mapped (None: no /proc to say)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return {line.rsplit(None, 1)[-1] for line in maps.splitlines() if ".so" in line}


def _has_cblas(lib: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(lib), "cblas_sgemm")
    except OSError:
        return False


def _openblas_core(lib: str) -> str:
    try:
        corename = ctypes.CDLL(lib).openblas_get_corename
    except (OSError, AttributeError):
        return "kernels unknown"
    corename.restype = ctypes.c_char_p
    return f"{corename().decode()} kernels"


def backend_name() -> str:
    """ "cpu", "metal" or "cuda": where MLX runs by default in this process."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
    return "cpu"


def describe() -> str:
    """One line for the startup log: the MLX backend and the BLAS behind its CPU matmuls."""
    backend = backend_name()
    blas = loaded_blas()
    if backend == "cpu" and "reference" in blas:
        hint = "install libopenblas0-pthread for 25-50x faster CPU inference"
        return f"backend=cpu blas={blas}: {hint}"
    return f"backend={backend} blas={blas}"
