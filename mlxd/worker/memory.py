"""MLX's allocator in a worker: the YAML's limits (`server.metal`) in, its figures out."""

from __future__ import annotations

import logging

import mlx.core as mx

from mlxd.accel import backend_name
from mlxd.config.server import MetalConfig

log = logging.getLogger("mlxd.worker")


def apply_limits(model: str, metal: MetalConfig) -> None:
    """Set what this backend supports: the buffer-cache limit on every backend, the wired
    limit on Metal only (it keeps the GPU's working set resident); what is ignored is said."""
    applied = []
    if metal.cache_limit is not None:
        mx.set_cache_limit(metal.cache_limit)
        applied.append(f"cache_limit={metal.cache_limit}")
    if metal.wired_limit is not None:
        backend = backend_name()
        if backend != "metal":
            log.info(
                "model '%s': server.metal.wired_limit ignored: MLX wires memory on Metal only "
                "(this worker runs on %s)",
                model,
                backend,
            )
        else:
            try:
                mx.set_wired_limit(metal.wired_limit)
                applied.append(f"wired_limit={metal.wired_limit}")
            except ValueError as exc:  # above the GPU's recommended working set
                log.warning("model '%s': server.metal.wired_limit not applied: %s", model, exc)
    if applied:
        log.info("model '%s': MLX memory limits set: %s", model, ", ".join(applied))


def figures() -> dict[str, int]:
    """What MLX's allocator holds in this process, for /v1/status."""
    return {
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_peak_bytes": mx.get_peak_memory(),
        "mlx_cache_bytes": mx.get_cache_memory(),
    }
