"""Several packed matmuls over the same input as one: q, k and v projections in one kernel call,
and an MLP's gate and up projections in another.

Each call of the kernels costs a dispatch and a wake of their threads, ≈7 µs on the CPU it was
measured on, whatever the matmul's size: at one decode row SmolLM2's three projections a
layer cost two calls more than one over their rows together, ≈0.2 ms of a ≈6 ms step (30
layers; the fastest steps took 5.9 ms apart, 5.7 fused). The packed layout is whole tiles of
rows, so the rows of several matrices one after another are the packed concatenation, and
each output is a slice of the fused one: the same arithmetic, the same numbers.

A LoRA adapter attaches to the projections by name (models/lora.py): `Fused.split` gives the
separate layers back first.

A load packs each group as one matrix's rows (models/groups.py), as the packed file keeps it,
so fusing copies nothing. Gate and up fuse only so (`fuse(copy=False)`): concatenating separate
arrays would hold two thirds of every MLP twice (an 8B's ≈2 GB).
"""

from __future__ import annotations

from itertools import accumulate
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from mlxd.kernels import Packed
from mlxd.models.groups import is_one_matrix, same_layout
from mlxd.models.packed import PackedLinear


class Fused(PackedLinear):
    """The rows of several packed linears in one; `widths`: each part's outputs."""

    def __init__(self, packed: Packed, bias: mx.array | None, widths: list[int]) -> None:
        super().__init__(packed, bias)
        ends = list(accumulate(widths))
        # Each part's output rows, once: `outputs` runs every layer of every step.
        self.parts = [slice(start, end) for start, end in zip([0, *ends[:-1]], ends, strict=True)]

    def outputs(self, x: mx.array) -> list[mx.array]:
        """Each part's output, as its own layer computes it."""
        y = self(x)
        return [y[..., rows] for rows in self.parts]

    def split(self) -> list[PackedLinear]:
        """The parts as layers of their own (evaluated: the caller may be another thread)."""
        parts = []
        bias = self.get("bias")
        for rows in self.parts:
            view = self.packed.rows(rows.start, rows.stop - rows.start)
            weight, scale_bias = mx.contiguous(view.weight), mx.contiguous(view.scale_bias)
            part_bias = None if bias is None else mx.contiguous(bias[rows])
            mx.eval(weight, scale_bias, *([] if part_bias is None else [part_bias]))
            packed = Packed(weight, scale_bias, self.bits, self.dot, self.precise)
            parts.append(PackedLinear(packed, part_bias))
        return parts


def fuse(layers: list[nn.Module], copy: bool = True) -> Fused | None:
    """`layers` as one `Fused`, or None unless all are `PackedLinear` of one layout (a
    `SplitLinear` of the mixed plan, a LoRA layer or MLX's own keep theirs), each with a bias or
    none has one. Layers that are consecutive rows of one kept matrix (`Packed.whole`) fuse
    into it as it is; others are concatenated (a copy: an 8B's q, k and v are 0.45 GiB), or
    with `copy` false left apart (None)."""
    if not all(type(layer) is PackedLinear for layer in layers):
        return None
    linears = cast(list[PackedLinear], layers)
    packed = [linear.packed for linear in linears]
    biases = [linear.get("bias") for linear in linears]
    if not same_layout(packed) or len({b is None for b in biases}) != 1:
        return None
    widths = [linear.output_dims for linear in linears]
    bias = None if biases[0] is None else mx.concatenate([cast(mx.array, b) for b in biases])
    if is_one_matrix(packed):
        fused = cast(Packed, packed[0].whole)
    elif not copy:
        return None
    else:
        first = packed[0]
        weight = mx.concatenate([p.weight for p in packed])
        scale_bias = mx.concatenate([p.scale_bias for p in packed])
        fused = Packed(weight, scale_bias, first.bits, first.dot, first.precise)
    # Now, on the loading thread (MLX streams belong to the thread that made them).
    mx.eval(fused.weight, fused.scale_bias, *([] if bias is None else [bias]))
    return Fused(fused, bias, widths)
