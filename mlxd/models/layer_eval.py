"""Start each decoder layer's compute as soon as its graph is built, on the CPU backend
(why and what it saves: `KernelAttention`)."""

from __future__ import annotations

import mlx.nn as nn

from mlxd.models.kernel_layers import KernelAttention


def evaluate_per_layer(model: nn.Module) -> int:
    """Make each of `model`'s kernel attention layers schedule its input for evaluation once
    built; how many (architectures without them are left as they are)."""
    layers = [m for _, m in model.named_modules() if isinstance(m, KernelAttention)]
    for layer in layers:
        layer.eager = True
    return len(layers)
