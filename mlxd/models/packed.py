"""Quantized layers that run on mlxd's CPU kernel (mlxd.kernels) instead of float32 BLAS.

On the CPU backend a quantized model used to be dequantized to float32 at load: MLX 0.32's own
quantized matmul is slower still. With the kernel the weights stay as stored (a Q4_1 GGUF: 4.5
bits a weight instead of 32), which is what bounds a decode step at small batches, and the
kernel also beats float32 BLAS at batch 32 (docs/performance.md). `pack_model` swaps every
`nn.QuantizedLinear` for a `PackedLinear`; a quantized embedding that is also the output
projection (tied) becomes a `PackedEmbedding`, one packed table for both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxd import kernels
from mlxd.kernels import Packed


class PackedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W in the kernel's packed layout; float32 out."""

    def __init__(self, packed: Packed, bias: mx.array | None) -> None:
        super().__init__()
        self.weight = packed.weight
        self.scale_bias = packed.scale_bias
        self.bits = packed.bits
        if bias is not None:
            self.bias = bias
        self.output_dims, self.input_dims = packed.shape

    @property
    def packed(self) -> Packed:
        return Packed(self.weight, self.scale_bias, self.bits)

    def __call__(self, x: mx.array) -> mx.array:
        y = kernels.qmatmul(x, self.packed)
        return y + self["bias"] if "bias" in self else y


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
    """A quantized embedding that is also the output projection (tied), held once: packed,
    `as_linear` on the kernel and lookups dequantizing their rows from the packed table
    (kernels.take_rows), or from the float32 copy where the plan keeps one (mixed)."""

    def __init__(
        self, embedding: nn.QuantizedEmbedding, path_for: Callable[[int], str] | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.dims = embedding.num_embeddings, embedding.dims
        self.output = _packed_linear(embedding, None, path_for)

    def __call__(self, ids: mx.array) -> mx.array:
        if isinstance(self.output, SplitLinear):
            return self.output.dense[ids]
        assert isinstance(self.output, PackedLinear)
        return kernels.take_rows(self.output.packed, ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.output(x)


def _pack(module: nn.QuantizedLinear | nn.QuantizedEmbedding) -> Packed:
    assert module.biases is not None  # affine quantization (see _packable)
    return kernels.pack(module.weight, module.scales, module.biases, module.group_size, module.bits)


def _packable(module: nn.Module) -> bool:
    if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return module.mode == "affine" and kernels.packable(
            module.weight.shape[0], module.group_size, module.bits
        )
    return False


def can_pack(model: nn.Module) -> bool:
    """Whether the kernels are built and take every quantized layer of `model` (and it has some)."""
    quantized = [
        m
        for _, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    ]
    return kernels.available() and bool(quantized) and all(map(_packable, quantized))


def _packed_linear(
    module: nn.QuantizedLinear | nn.QuantizedEmbedding,
    bias: mx.array | None,
    path_for: Callable[[int], str] | None,
) -> nn.Module:
    packed = PackedLinear(_pack(module), bias)
    if path_for is None:
        return packed
    assert module.biases is not None  # affine (see _packable)
    dense = mx.dequantize(
        module.weight, module.scales, module.biases, module.group_size, module.bits
    ).astype(mx.float32)
    mx.eval(dense)  # now: a lazy copy would hold on to the stored layer until the end
    return SplitLinear(packed, dense, path_for)


def _module_at(model: nn.Module, name: str) -> nn.Module:
    """The submodule at dotted `name`, as `named_modules` spells it (list items by index)."""
    module: Any = model
    for part in name.split("."):
        module = module[int(part)] if isinstance(module, list) else module[part]
    assert isinstance(module, nn.Module)
    return module


def pack_model(model: nn.Module, path_for: Callable[[int], str] | None = None) -> None:
    """Swap `model`'s quantized layers for packed ones in place (see `can_pack`); with
    `path_for(rows)` each also keeps its float32 weights for the rows it gives to "float32".

    One layer at a time: packing reads the stored arrays, and each layer's are released (and
    MLX's buffer cache emptied) as soon as its packed one is in place, so a load holds the
    packed model and one stored layer, not two whole models (an 8B Q4_K_M peaked at twice its
    weights when every layer was swapped at the end).
    """
    # An embedding needs a packed copy only as a tied output projection: mlx-lm's models
    # have an `lm_head` exactly when theirs is separate (Llama-3.1-8B's: 0.5 GiB unused).
    tied = "lm_head" not in model
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding) if tied else (nn.QuantizedLinear,)
    # Largest first (a 128k-vocabulary embedding): its stored and packed copies and the
    # repacking's temporaries then coexist with none of the other packed layers.
    sizes = [(m.weight.nbytes, name) for name, m in model.named_modules() if isinstance(m, kinds)]
    names = [name for _, name in sorted(sizes, key=lambda size_name: -size_name[0])]
    for name in names:
        module = _module_at(model, name)
        replacement: nn.Module
        if isinstance(module, nn.QuantizedLinear):
            replacement = _packed_linear(module, module.get("bias"), path_for)
        else:
            assert isinstance(module, nn.QuantizedEmbedding)
            replacement = PackedEmbedding(module, path_for)
        del module  # the last reference but the model's, which the update drops
        model.update_modules(tree_unflatten([(name, replacement)]))
        mx.clear_cache()
