"""Quantized layers that run on mlxd's CPU kernel (mlxd.kernels) instead of float32 BLAS.

On the CPU backend a quantized model used to be dequantized to float32 at load: MLX 0.32's own
quantized matmul is slower still. With the kernel the weights stay as stored (a Q4_1 GGUF: 4.5
bits a weight instead of 32), which is what bounds a decode step at small batches, and the
kernel also beats float32 BLAS at batch 32 (docs/performance.md). `pack_model` swaps every
`nn.QuantizedLinear` for a `PackedLinear`; a quantized embedding that is also the output
projection (tied) becomes a `PackedEmbedding`, one packed table for both.

A model may mix widths (mlx-community's `mixed_*` recipes, a 6-bit head over a 4-bit body, a
GGUF's IQ4 tensors imported at 6 bits): the layers the kernels take run packed and the others
are dequantized to float32 for BLAS (`dequantize_layers`), which MLX's own quantized matmul
is 2-4x slower than on the CPU; the loader says which and why (`packability.unpackable_layers`).

A mixture of experts' stacked expert matrices (mlx-lm's `QuantizedSwitchLinear`, called by its
`SwitchGLU` / `SwitchMLP` with each token's expert indices) become a `PackedSwitchLinear`,
multiplied by the kernels' gather matmul (csrc/gather_qmatmul.cpp) instead of MLX's CPU
`gather_qmm`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxd import kernels
from mlxd.kernels import KERNEL_BITS, Packed
from mlxd.models.groups import as_one_matrix, group_of
from mlxd.models.packability import (
    Quantized,
    expert_stacks,
    is_lm_head,
    quantized_layers,
    why_layer_not_packable,
)


class PackedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W in the kernel's packed layout; float32 out."""

    def __init__(self, packed: Packed, bias: mx.array | None) -> None:
        super().__init__()
        self.weight = packed.weight
        self.scale_bias = packed.scale_bias
        self.bits = packed.bits
        self.dot, self.precise = packed.dot, packed.precise
        if bias is not None:
            self.bias = bias
        self.output_dims, self.input_dims = packed.shape
        # Not parameters (a Packed is no array tree): what models/fused.py fuses without a copy.
        self.whole, self.first_row = packed.whole, packed.first_row

    @property
    def packed(self) -> Packed:
        return Packed(
            self.weight,
            self.scale_bias,
            self.bits,
            self.dot,
            self.precise,
            self.whole,
            self.first_row,
        )

    def __call__(self, x: mx.array) -> mx.array:
        y = kernels.qmatmul(x, self.packed)
        return y + self["bias"] if "bias" in self else y


class PackedSwitchLinear(nn.Module):
    """mlx-lm's `QuantizedSwitchLinear` with its E expert matrices packed for the kernels'
    gather matmul: y[..., m, :] = x[..., m, :] @ W[indices[...]].T (+ bias[indices]), as
    `mx.gather_qmm` with `transpose`; float32 out."""

    def __init__(self, experts: Packed, bias: mx.array | None) -> None:
        super().__init__()
        self.weight = experts.weight
        self.scale_bias = experts.scale_bias
        self.bits = experts.bits
        self.dot, self.precise = experts.dot, experts.precise
        if bias is not None:
            self.bias = bias
        self.num_experts = experts.weight.shape[0]
        self.output_dims, self.input_dims = experts.shape

    @property
    def packed(self) -> Packed:
        return Packed(self.weight, self.scale_bias, self.bits, self.dot, self.precise)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # sorted_indices (SwitchGLU sorted the pairs by expert): the kernel groups them itself.
        *lead, rows, inputs = x.shape
        batch = tuple(indices.shape)
        if (
            rows == 1
            and len(lead) == len(batch)
            and lead[-1:] == [1]
            and lead[:-1] == [*batch[:-1]]
        ):
            # One x per token for its J experts (SwitchGLU's first projections, unsorted): the
            # kernel takes x [T, K] and indices [T, J] without copying x J times.
            y = kernels.gather_qmatmul(
                x.reshape(-1, inputs), indices.reshape(-1, batch[-1]), self.packed
            )
        else:  # one x row per (index, row): broadcast both
            batch = mx.broadcast_shapes(tuple(lead), batch)
            flat = mx.broadcast_to(x, (*batch, rows, inputs)).reshape(-1, inputs)
            per_row = mx.broadcast_to(mx.expand_dims(indices, -1), (*batch, rows))
            y = kernels.gather_qmatmul(flat, per_row.reshape(-1, 1), self.packed)
        y = y.reshape(*batch, rows, self.output_dims)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y


class SplitLinear(nn.Module):
    """Both weight sets of one matmul (models/cpu_path.py's "mixed" plan): the packed layer
    for the row counts `path_for` gives to "packed", float32 BLAS for the others."""

    def __init__(
        self, packed: PackedLinear, dense: mx.array, path_for: Callable[[int], str]
    ) -> None:
        super().__init__()
        self.packed_linear = packed
        self.dense = dense
        self._path_for = path_for

    def __call__(self, x: mx.array) -> mx.array:
        if self._path_for(x.size // x.shape[-1]) == "packed":
            return self.packed_linear(x)
        y = x @ self.dense.T
        return y + self.packed_linear["bias"] if "bias" in self.packed_linear else y


class PackedEmbedding(nn.Module):
    """A quantized embedding that is also the output projection (tied), held once: packed in
    the plan's layout, `as_linear` on the kernel and lookups dequantizing their rows from the
    packed table (kernels.take_rows), or from the float32 copy where the plan keeps one
    (mixed)."""

    def __init__(
        self,
        embedding: nn.QuantizedEmbedding,
        packed: Packed,
        path_for: Callable[[int], str] | None = None,
        dense: mx.array | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.dims = embedding.num_embeddings, embedding.dims
        self.output = _packed_linear(embedding, None, path_for, packed, dense)

    def __call__(self, ids: mx.array) -> mx.array:
        if isinstance(self.output, SplitLinear):
            return self.output.dense[ids]
        assert isinstance(self.output, PackedLinear)
        return kernels.take_rows(self.output.packed, ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.output(x)


def _pack_experts(module: QuantizedSwitchLinear, dot: bool, precise: bool) -> Packed:
    """`kernels.pack_experts` of any width MLX stores, at the width the kernels run it (with
    `dot` for the int8 dot products, as `pack`)."""
    assert module.biases is not None  # affine quantization (see why_layer_not_packable)
    weight, width = module.weight, KERNEL_BITS[module.bits]
    if width != module.bits:
        experts, rows, _ = weight.shape
        flat = kernels.widen(weight.reshape(experts * rows, -1), module.bits, width)
        weight = flat.reshape(experts, rows, -1)
    return kernels.pack_experts(
        weight,
        module.scales,
        module.biases,
        module.group_size,
        width,
        dot,
        dot and precise,
        round_scales=_rounds_scales(dot, precise),
    )


def _pack(
    module: nn.QuantizedLinear | nn.QuantizedEmbedding, dot: bool, precise: bool = True
) -> Packed:
    assert module.biases is not None  # affine quantization (see why_layer_not_packable)
    weight, scales, biases = module.weight, module.scales, module.biases
    return pack(weight, scales, biases, module.group_size, module.bits, dot, precise)


def pack(
    weight: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    dot: bool = False,
    precise: bool = True,
) -> Packed:
    """`kernels.pack` (or with `dot` `kernels.pack_dot`, x as two int8 terms unless not
    `precise`) of any width MLX stores, at the width the kernels run it (KERNEL_BITS)."""
    width = KERNEL_BITS[bits]
    if width != bits:
        weight = kernels.widen(weight, bits, width)
    if dot:
        return kernels.pack_dot(
            weight,
            scales,
            biases,
            group_size,
            width,
            precise=precise,
            round_scales=_rounds_scales(dot, precise),
        )
    return kernels.pack(weight, scales, biases, group_size, width)


def _rounds_scales(dot: bool, precise: bool) -> bool:
    """Whether a layout keeps float32 scales and biases (a K-quant GGUF's d times a 6-bit
    scale, which a float16 cannot always hold) as float16: where x is one int8 term
    (llama.cpp's rounding: `dot` and not `precise`). A 4-bit weight then streams 5 bits, not 6
    (per 32 codes a scale and a bias): a Q4_K_M model is ≈15% fewer bytes. The rounding moves
    a scale or bias by at most 2^-11 of it, but the same way for a whole group, so its error
    in a dot product is of the order of x's own rounding to one term, not below it: on SmolLM2
    requantized to Q4_K_M the logits part from its exact float32 twin's by 0.96-1.63 with
    float16 scales, 1.08-1.16 with exact ones (docs/performance.md). precise keeps the exact
    values, as the converted directory does."""
    return dot and not precise


def dequantize_layers(model: nn.Module, names: Iterable[str]) -> None:
    """Swap these quantized layers for float32 ones of the weights they hold."""
    replacements: list[tuple[str, nn.Module]] = []
    for name in names:
        module = _module_at(model, name)
        assert isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding)
        dense = mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            module.group_size,
            module.bits,
            mode=module.mode,
        ).astype(mx.float32)
        replacement: nn.Module
        if isinstance(module, nn.QuantizedEmbedding):
            replacement = nn.Embedding(*dense.shape)
        else:
            replacement = nn.Linear(dense.shape[1], dense.shape[0], bias="bias" in module)
            if "bias" in module:
                replacement.bias = module["bias"]
        replacement.weight = dense
        replacements.append((name, replacement))
    model.update_modules(tree_unflatten(replacements))


def _packed_linear(
    module: nn.QuantizedLinear | nn.QuantizedEmbedding,
    bias: mx.array | None,
    path_for: Callable[[int], str] | None,
    weights: Packed,
    kept: mx.array | None = None,
) -> nn.Module:
    """The packed layer, with `path_for` beside its float32 weights: `kept` where it is
    their shape (mapped from the packed file), else dequantized here."""
    packed = PackedLinear(weights, bias)
    if path_for is None:
        return packed
    if kept is not None and kept.shape == tuple(weights.shape) and kept.dtype == mx.float32:
        return SplitLinear(packed, kept, path_for)
    assert module.biases is not None  # affine (see why_layer_not_packable)
    dense = mx.dequantize(
        module.weight, module.scales, module.biases, module.group_size, module.bits
    ).astype(mx.float32)
    mx.eval(dense)  # now: a lazy copy would hold on to the stored layer until the end
    return SplitLinear(packed, dense, path_for)


def _pack_group_as_one(model: nn.Module, layers: dict[str, Packed], name: str) -> None:
    """Where `name` completes a group models/fused.py fuses, its layers as rows of one matrix
    (models/groups.py), as the packed file keeps them: fusing them then copies nothing. Layers
    kept beside float32 weights (the mixed plan) stay as they are."""
    found = group_of(name, layers)
    if found is None:
        return
    linears = {part: _module_at(model, part) for part in found[1]}
    if not all(type(linear) is PackedLinear for linear in linears.values()):
        return
    for part in as_one_matrix(layers, name):
        bias = linears[part].get("bias")
        model.update_modules(tree_unflatten([(part, PackedLinear(layers[part], bias))]))


def _module_at(model: nn.Module, name: str) -> nn.Module:
    """The submodule at dotted `name`, as `named_modules` spells it (list items by index)."""
    module: Any = model
    for part in name.split("."):
        module = module[int(part)] if isinstance(module, list) else module[part]
    assert isinstance(module, nn.Module)
    return module


def fits(packed: Packed, module: Quantized, dot: bool, precise: bool = True) -> bool:
    """Whether `packed` (e.g. read from models/packed_cache.py) is `module`'s weights in the
    layout asked for: shapes, widths, dtypes and layout flags (not the values). An expert
    stack [E, N, ...] is E matrices laid out one after another."""
    *experts, rows, words = module.weight.shape
    inputs = words * 32 // module.bits
    width = KERNEL_BITS[module.bits]
    groups = inputs // kernels.scale_group(module.group_size)
    tiles = (*experts, rows // kernels.LANES, groups, 2, kernels.LANES)
    return (
        packed.bits == width
        and packed.dot == dot
        and packed.precise == (dot and precise)
        and packed.weight.dtype == mx.uint8
        and packed.weight.shape == (*experts, rows, inputs * width // 8)
        and packed.scale_bias.dtype in (mx.float16, mx.float32)
        and packed.scale_bias.shape == tiles
    )


def is_head(name: str, module: nn.Module) -> bool:
    """Whether the layer at `name` is the output head: lm_head, or an embedding (packed only
    where tied, so it is the head as well)."""
    return is_lm_head(name) or isinstance(module, nn.QuantizedEmbedding)


def pack_model(
    model: nn.Module,
    path_for: Callable[[int], str] | None = None,
    dot: bool = False,
    cached: dict[str, Packed] | None = None,
    precise: bool = True,
    dense: Mapping[str, mx.array] | None = None,
    head_dot: bool | None = None,
) -> tuple[dict[str, Packed], int]:
    """Swap `model`'s quantized layers the kernels take for packed ones in place (a mixture of
    experts' stacks too: `PackedSwitchLinear`); with `path_for(rows)` each linear also keeps its
    float32 weights for the rows it gives to "float32"; with `dot` the linears and experts are
    multiplied as int8 dot products (kernels.pack_dot, x as two int8 terms unless not
    `precise`: cpu_activations int8), a tied embedding too (its lookups read
    either layout: kernels.take_rows); `head_dot`, where given, says it for the output head
    (lm_head or the tied embedding) apart from the other layers. A layer whose packed weights are
    in `cached` (by name; taken out of it, so that a part of a group regrouped here is freed)
    and `fits` takes them as they are, and a float32 copy for `path_for`
    found in `dense` (by parameter path, as models/packed_cache.py keeps a model's other arrays)
    is taken instead of dequantizing. Returns the packed weights by layer name, and how many
    layers were packed here.

    One layer at a time: packing reads the stored arrays, and each layer's are released (and
    MLX's buffer cache emptied) as soon as its packed one is in place, so a load holds the
    packed model and one stored layer, not two whole models (an 8B Q4_K_M peaked at twice its
    weights when every layer was swapped at the end).
    """
    # An untied embedding gets no packed copy (Llama-3.1-8B's would be 0.5 GiB unused).
    # Largest first (a 128k-vocabulary embedding): its stored and packed copies and the
    # repacking's temporaries then coexist with none of the other packed layers.
    # (Names only: a reference to a stored layer would keep it alive through the loop.)
    packable = [
        (m.weight.nbytes, n)
        for n, m in {**quantized_layers(model), **expert_stacks(model)}.items()
        if not why_layer_not_packable(m)
    ]
    names = [name for _, name in sorted(packable, key=lambda size_name: -size_name[0])]
    layers: dict[str, Packed] = {}
    reused = 0
    for name in names:
        module = _module_at(model, name)
        assert isinstance(module, Quantized)
        as_dot = head_dot if head_dot is not None and is_head(name, module) else dot
        weights = cached.pop(name, None) if cached is not None else None
        if weights is not None and fits(weights, module, as_dot, precise):
            reused += 1
        else:
            if isinstance(module, QuantizedSwitchLinear):
                weights = _pack_experts(module, as_dot, precise)
            else:
                weights = _pack(module, as_dot, precise)
        layers[name] = weights
        replacement: nn.Module
        if isinstance(module, QuantizedSwitchLinear):  # experts: always packed, no float32 copy
            replacement = PackedSwitchLinear(weights, module.get("bias"))
        elif isinstance(module, nn.QuantizedLinear):
            kept = (dense or {}).get(f"{name}.dense")
            replacement = _packed_linear(module, module.get("bias"), path_for, weights, kept)
        else:
            kept = (dense or {}).get(f"{name}.output.dense")
            replacement = PackedEmbedding(module, weights, path_for, kept)
        del module  # the last reference but the model's, which the update drops
        model.update_modules(tree_unflatten([(name, replacement)]))
        del replacement, weights  # (the group's parts, where the next call replaces them)
        _pack_group_as_one(model, layers, name)
        mx.clear_cache()
    return layers, len(layers) - reused
