"""A GELU for the MLX CPU backend that avoids its slow transcendental functions.

On the CPU backend MLX evaluates `erf` (and `exp`, `tanh`) element by element at ≈10–20 M
values/s, while multiply-adds run hundreds of times faster: in a BERT encoder at batch 64 the
exact GELU took longer than all the matmuls together. Eigen's float32 erf approximation (a
rational function of x², used by TensorFlow and XLA) needs only multiply-adds and one division;
compiled into one kernel it is ≈20x faster and within 1.5e-6 of `nn.gelu` everywhere.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Eigen's generic_fast_erf_float: erf(z) = z · P(z²) / Q(z²) on [-4, 4] (±1 beyond).
_P = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_Q = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


@mx.compile
def gelu_rational(x: mx.array) -> mx.array:
    """Exact (erf) GELU to float32 precision, from multiply-adds only."""
    z = mx.clip(x * 0.7071067811865476, -4.0, 4.0)
    z2 = z * z
    p = mx.array(_P[0], dtype=x.dtype)
    for coefficient in _P[1:]:
        p = p * z2 + coefficient
    q = mx.array(_Q[0], dtype=x.dtype)
    for coefficient in _Q[1:]:
        q = q * z2 + coefficient
    return 0.5 * x * (1.0 + z * p / q)


class RationalGELU(nn.Module):
    def __call__(self, x: mx.array) -> mx.array:
        return gelu_rational(x)


def use_rational_gelu(model: nn.Module) -> int:
    """Swap every exact `nn.GELU` module of `model` for `RationalGELU`; returns how many."""
    swapped = 0
    for _, module in model.named_modules():
        for key, child in module.children().items():
            if _is_exact_gelu(child):
                setattr(module, key, RationalGELU())
                swapped += 1
            elif isinstance(child, list):  # e.g. nn.Sequential's layers
                items = module[key]  # children() hands out copies of lists
                for index, item in enumerate(items):
                    if _is_exact_gelu(item):
                        items[index] = RationalGELU()
                        swapped += 1
    return swapped


def _is_exact_gelu(module: object) -> bool:
    return type(module) is nn.GELU and module._approx == "none"
