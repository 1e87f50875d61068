"""Where MLX's CUDA backend keeps the kernels it compiles.

MLX compiles a CUDA kernel the first time it meets it and keeps it under the system's
temporary directory (/tmp/mlx/<version>/ptx) unless MLX_PTX_CACHE_DIR names another; a reboot
empties /tmp, and with it tens of seconds of compiling the first requests would wait for again
(docs/performance.md). A worker keeps them under the server's cache_dir instead, one folder per
MLX version and GPU architecture (a kernel compiled for one card must not run on another).
"""

from __future__ import annotations

import logging
import os
import re
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx

from mlxd.accel import backend_name

log = logging.getLogger("mlxd.worker")

ENV = "MLX_PTX_CACHE_DIR"


def keep_jit_cache(cache_dir: Path) -> Path | None:
    """Point MLX at a folder under `cache_dir`, on CUDA, unless the user chose one; before
    the first compile (MLX reads the variable once). Returns the folder, or None."""
    if backend_name() != "cuda" or ENV in os.environ:
        return None
    try:
        info = mx.device_info()
        device = str(info.get("architecture") or info.get("device_name") or "gpu")
        folder = cache_dir / "mlx-jit" / re.sub(r"[^\w.-]+", "_", f"{version('mlx')}-{device}")
        folder.mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # the load goes on; only the kept kernels are lost
        log.warning("MLX keeps its compiled kernels in /tmp: none under %s (%s)", cache_dir, exc)
        return None
    os.environ[ENV] = str(folder)
    return folder
