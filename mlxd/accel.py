"""Where MLX computes: the backend (cpu/metal/cuda) and, on the CPU, the BLAS behind matmuls.

The Linux MLX CPU wheel bundles the reference BLAS (≈4 GFLOP/s). Preloading an optimized
libblas.so.3 (Debian's OpenBLAS) interposes `cblas_sgemm` & co. and runs the same float32
matmuls 25-50x faster. A preload only works from process start, so mlxd re-executes itself
once with LD_PRELOAD set when it finds such a library and it is not already loaded.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("mlxd.accel")

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


def find_optimized_blas() -> str | None:
    return next((path for path in CANDIDATES if Path(path).exists()), None)


def loaded_blas() -> str:
    """Name the BLAS this process has mapped: an optimized one, MLX's bundled reference, or none."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "platform default"  # macOS: MLX uses Accelerate
    libs = {line.rsplit(None, 1)[-1] for line in maps.splitlines() if ".so" in line}
    for lib in sorted(libs):
        if any(marker in lib.lower() for marker in OPTIMIZED_MARKERS):
            return Path(lib).name if "openblas" not in lib else f"OpenBLAS ({lib})"
    if any("libblas" in lib for lib in libs):
        return "reference BLAS (slow)"
    return "not loaded yet"


def ensure_optimized_blas(argv: list[str] | None = None) -> None:
    """Re-exec the current command with an optimized BLAS preloaded, when that helps.

    Does nothing off Linux, when one is already preloaded, when none is installed, when
    MLXD_NO_REEXEC is set, or inside the re-executed child.
    """
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_GUARD):
        return
    if os.environ.get("MLXD_NO_REEXEC", "").lower() in ("1", "true", "yes"):
        return
    blas = find_optimized_blas()
    preload = os.environ.get("LD_PRELOAD", "")
    if blas is None or blas in preload.split(":"):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{blas}:{preload}" if preload else blas
    env[REEXEC_GUARD] = "1"
    args = argv if argv is not None else sys.argv
    os.execve(sys.executable, [sys.executable, "-m", "mlxd", *args[1:]], env)


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
