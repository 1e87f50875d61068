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

A load makes each group's packed layers rows of one matrix as it packs them
(`keep_groups_whole`, one group at a time), as the packed file keeps them, so fusing copies
nothing: concatenating at the swap would hold two thirds of every MLP twice (an 8B's ≈2 GB)
while the separate arrays are still held for the packed file's write. Gate and up fuse only
so (`fuse(copy=False)`); q, k and v of separate arrays are still concatenated.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import accumulate
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxd.host_memory import trim_heap
from mlxd.kernels import Packed
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


# The projections fused, by the name of their fusion (KernelAttention's, RationalSwiGLU's), in
# their order.
GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def same_layout(packed: list[Packed]) -> bool:
    """Whether these matrices' rows can stand one after another as one matrix."""
    layouts = {(p.bits, p.dot, p.precise, p.scale_bias.dtype, p.shape[1], p.group) for p in packed}
    return len(layouts) == 1


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
    whole = linears[0].whole
    starts = [0, *accumulate(widths)]
    if (
        whole is not None
        and all(linear.whole is whole for linear in linears)
        and [linear.first_row for linear in linears] == starts[:-1]
        and whole.shape[0] == starts[-1]
    ):
        fused = whole
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


def fused_groups(layers: Mapping[str, Packed]) -> dict[str, list[str]]:
    """The layers `fuse` takes (a layer's q, k and v projections, its gate and up, each group
    packed alike), by the name of their fusion: kept as that one matrix, so that a load maps
    it whole and fuses nothing (a concatenation copied an 8B's 0.45 GiB at every load)."""
    groups: dict[str, list[str]] = {}
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        for fusion, members in GROUPS.items():
            parts = [f"{parent}.{member}" for member in members]
            if (
                leaf == members[0]
                and all(part in layers for part in parts)
                and same_layout([layers[part] for part in parts])
            ):
                groups[f"{parent}.{fusion}"] = parts
    return groups


def keep_groups_whole(model: nn.Module, layers: dict[str, Packed]) -> None:
    """The layers `fuse` takes that this load packed (`pack_model`'s `layers`, updated), made
    views of one matrix per group, as a cached load maps them from the packed file: fusing
    them then copies nothing, and the file's write keeps that one matrix. One group at a time,
    so a load holds one group's weights twice at most, and only until its parts are dropped
    (the caller's own references to them too)."""
    modules = dict(model.named_modules())
    for parts in fused_groups(layers).values():
        packed = [layers[part] for part in parts]
        if packed[0].whole is not None and all(p.whole is packed[0].whole for p in packed):
            continue  # already one matrix's rows (the packed file's)
        linears = [modules.pop(part) for part in parts]  # (the last references but the model's)
        if not all(type(linear) is PackedLinear for linear in linears):
            continue  # the mixed plan's SplitLinear keeps its own
        first = packed[0]
        weight = mx.concatenate([p.weight for p in packed])
        scale_bias = mx.concatenate([p.scale_bias for p in packed])
        mx.eval(weight, scale_bias)
        whole = Packed(weight, scale_bias, first.bits, first.dot, first.precise)
        row = 0
        for part, linear, p in zip(parts, linears, packed, strict=True):
            view = whole.rows(row, p.shape[0])
            row += p.shape[0]
            layers[part] = view
            model.update_modules(tree_unflatten([(part, PackedLinear(view, linear.get("bias")))]))
        del packed, linears
        mx.clear_cache()
        trim_heap()  # the parts' blocks, else resident while the heap grows past them
