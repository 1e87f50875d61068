"""Quantized layers that run on mlxd's CPU kernel (mlxd.kernels) instead of float32 BLAS.

On the CPU backend a quantized model used to be dequantized to float32 at load: MLX 0.32's own
quantized matmul is slower still. With the kernel the weights stay as stored (a Q4_1 GGUF: 4.5
bits a weight instead of 32), which is what bounds a decode step at small batches, and the
kernel also beats float32 BLAS at batch 32 (docs/performance.md). `pack_model` swaps every
`nn.QuantizedLinear` for a `PackedLinear`; a quantized embedding keeps its table for lookups
and gains a packed copy for the tied output projection (`as_linear`).
"""

from __future__ import annotations

from collections.abc import Callable

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
        self.dot, self.precise = packed.dot, packed.precise
        if bias is not None:
            self.bias = bias
        self.output_dims, self.input_dims = packed.shape

    @property
    def packed(self) -> Packed:
        return Packed(self.weight, self.scale_bias, self.bits, self.dot, self.precise)

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


class PackedEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding whose `as_linear` (tied output projection) runs packed."""

    def __init__(
        self,
        embedding: nn.QuantizedEmbedding,
        path_for: Callable[[int], str] | None = None,
        dot: bool = False,
    ) -> None:
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = embedding.group_size, embedding.bits, "affine"
        self.num_embeddings, self.dims = embedding.num_embeddings, embedding.dims
        self.weight, self.scales, self.biases = embedding.weight, embedding.scales, embedding.biases
        self.output = _packed_linear(embedding, None, path_for, dot)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.output(x)


def _pack(module: nn.QuantizedLinear | nn.QuantizedEmbedding, dot: bool) -> Packed:
    assert module.biases is not None  # affine quantization (see _packable)
    args = (module.weight, module.scales, module.biases, module.group_size, module.bits)
    return kernels.pack_dot(*args, precise=True) if dot else kernels.pack(*args)


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
    dot: bool = False,
) -> nn.Module:
    packed = PackedLinear(_pack(module, dot), bias)
    if path_for is None:
        return packed
    assert module.biases is not None  # affine (see _packable)
    dense = mx.dequantize(
        module.weight, module.scales, module.biases, module.group_size, module.bits
    ).astype(mx.float32)
    return SplitLinear(packed, dense, path_for)


def pack_model(
    model: nn.Module, path_for: Callable[[int], str] | None = None, dot: bool = False
) -> None:
    """Swap `model`'s quantized layers for packed ones in place (see `can_pack`); with
    `path_for(rows)` each also keeps its float32 weights for the rows it gives to "float32";
    with `dot` the weights are multiplied as int8 dot products (kernels.pack_dot, precise)."""
    replacements: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            bias = module.get("bias")
            replacements.append((name, _packed_linear(module, bias, path_for, dot)))
        elif isinstance(module, nn.QuantizedEmbedding):
            replacements.append((name, PackedEmbedding(module, path_for, dot)))
    model.update_modules(tree_unflatten(replacements))
