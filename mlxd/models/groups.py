"""The packed matmuls that run as one (models/fused.py): a layer's q, k and v projections, an
MLP's gate and up. A load packs each such group as one matrix's rows (`one_matrix`), which is
how the packed file keeps it (models/packed_cache.py), so fusing the group copies nothing."""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

from mlxd.kernels import Packed

# The projections fused, by the name of their fusion (KernelAttention's, RationalSwiGLU's), in
# their order.
GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def same_layout(packed: list[Packed]) -> bool:
    """Whether these matrices' rows can stand one after another as one matrix."""
    layouts = {(p.bits, p.dot, p.precise, p.scale_bias.dtype, p.shape[1], p.group) for p in packed}
    return len(layouts) == 1


def fused_groups(layers: Mapping[str, Packed]) -> dict[str, list[str]]:
    """The groups of `layers` that fuse (all their members there, packed alike), by the name of
    their fusion: each kept as one matrix, so that a load maps it whole and fuses nothing (a
    concatenation copied an 8B's 0.45 GiB at every load)."""
    groups: dict[str, list[str]] = {}
    for name in layers:
        if (found := group_of(name, layers)) is not None and name == found[1][0]:
            groups[found[0]] = found[1]
    return groups


def members_of(name: str) -> tuple[str, list[str]] | None:
    """The fusion a layer named `name` belongs to by its name (e.g. "model.layers.0.mlp.up_proj":
    "model.layers.0.mlp.gate_up_proj"), and its members' names in order; else None."""
    parent, _, leaf = name.rpartition(".")
    prefix = f"{parent}." if parent else ""
    for fusion, members in GROUPS.items():
        if leaf in members:
            return prefix + fusion, [prefix + member for member in members]
    return None


def group_of(name: str, layers: Mapping[str, Packed]) -> tuple[str, list[str]] | None:
    """The fusion `name` belongs to and its members, where all of them are in `layers` and
    packed alike; else None."""
    found = members_of(name)
    if found is None:
        return None
    parts = found[1]
    if all(part in layers for part in parts) and same_layout([layers[p] for p in parts]):
        return found
    return None


def is_one_matrix(packed: list[Packed]) -> bool:
    """Whether these are consecutive rows of one matrix, in order (`Packed.whole`)."""
    whole, row = packed[0].whole, 0
    for p in packed:
        if whole is None or p.whole is not whole or p.first_row != row:
            return False
        row += p.shape[0]
    return whole is not None and whole.shape[0] == row


def as_one_matrix(layers: dict[str, Packed], name: str) -> list[str]:
    """Where `name` completes a group of `layers` not yet one matrix, its entries replaced by
    views of one (evaluated); the names replaced (else none). Called as each layer is packed,
    so that the parts' memory goes to the next layers' (regrouped after a whole model, a 1B's
    first load kept 0.28 GiB more resident, an 8B GGUF's 1.3 GiB)."""
    found = group_of(name, layers)
    if found is None or is_one_matrix([layers[part] for part in found[1]]):
        return []
    parts = found[1]
    for part, view in zip(parts, one_matrix([layers[part] for part in parts]), strict=True):
        layers[part] = view
    return parts


def one_matrix(packed: list[Packed]) -> list[Packed]:
    """`packed` as consecutive rows of one matrix (evaluated), each a view of it."""
    first = packed[0]
    weight = mx.concatenate([p.weight for p in packed])
    scale_bias = mx.concatenate([p.scale_bias for p in packed])
    mx.eval(weight, scale_bias)
    whole = Packed(weight, scale_bias, first.bits, first.dot, first.precise)
    views, row = [], 0
    for p in packed:
        views.append(whole.rows(row, p.shape[0]))
        row += p.shape[0]
    # The slices too (views still, once evaluated): a conversion hands them to a load that
    # may run on another thread, which cannot evaluate the stream of the thread made them.
    mx.eval([(view.weight, view.scale_bias) for view in views])
    return views
