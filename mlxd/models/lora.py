"""Several LoRA adapters over one copy of a model's weights (multi-LoRA), in one batch.

Each adapted linear layer becomes a `MultiLoRALinear`: the base layer plus every attached
adapter's matrices side by side, A as [in, R] and B as [R, out] (R: the ranks of the adapters
that touch this layer, summed). Before each forward pass the batch says which adapter each of
its rows uses (`MultiLoRA.set_rows`); a row's mask keeps only its own adapter's columns, so one
pair of plain matmuls serves base rows and any mix of adapters (measured faster on the CPU than
gathering per-row matrices or running one batch per adapter). A base row's mask is all zero:
its output is the base layer's, exactly. Slots are only ever appended, so a detached adapter's
slot is simply no longer routed to.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from mlxd.models.adapters import CONFIG_FILE, WEIGHTS_FILE, adapter_problem
from mlxd.models.kernel_layers import split_fused_projections
from mlxd.models.packed import PackedLinear, SplitLinear


class Rows:
    """The current forward pass's adapter slot per batch row (None: every row is the base),
    and each row's LoRA scale."""

    def __init__(self) -> None:
        self.slots: mx.array | None = None
        self.scales: mx.array | None = None


@dataclass(frozen=True)
class _Stack:
    a: mx.array  # [in, R]
    b: mx.array  # [R, out]
    slot_of_column: mx.array  # [R]: which slot each of the R columns belongs to


class MultiLoRALinear(nn.Module):
    def __init__(self, linear: nn.Module, rows: Rows):
        super().__init__()
        self.linear = linear
        # Plain attributes, not parameters: replaced whole (one assignment) on attach, so a
        # forward pass on the model thread sees the old stack or the new one.
        self._rows = rows
        self._stack: _Stack | None = None

    def add(self, slot: int, a: mx.array, b: mx.array) -> None:
        columns = mx.full((a.shape[1],), slot, dtype=mx.int32)
        old = self._stack
        stack = (
            _Stack(a, b, columns)
            if old is None
            else _Stack(
                mx.concatenate([old.a, a], axis=1),
                mx.concatenate([old.b, b], axis=0),
                mx.concatenate([old.slot_of_column, columns]),
            )
        )
        mx.eval(stack.a, stack.b, stack.slot_of_column)
        self._stack = stack

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        stack, slots, scales = self._stack, self._rows.slots, self._rows.scales
        if stack is None or slots is None or scales is None:
            return y
        mask = (stack.slot_of_column[None, :] == slots[:, None]).astype(x.dtype)
        z = ((x @ stack.a) * mask[:, None, :]) @ stack.b
        # As mlx-lm's LoRALinear: y + (scale * z) in x's dtype.
        return y + (scales[:, None, None] * z).astype(x.dtype)


class MultiLoRA:
    """The adapters attached to one loaded model; slot 0 is the base model itself."""

    def __init__(self, model: nn.Module, dtype: mx.Dtype | None):
        """`dtype`: the model's compute dtype, for the adapters too (None: as stored)."""
        self.model = model
        self.dtype = dtype
        self.rows = Rows()
        self._scales = [0.0]
        self._layers: dict[str, MultiLoRALinear] = {}
        self._lock = threading.Lock()  # attaches (off the model thread) one at a time

    def attach(self, adapter: Path) -> int:
        """Load the adapter directory (mlx-lm's format) into a new slot; returns the slot.
        Raises ValueError saying why it does not fit the model (nothing is changed then but
        fused q/k/v projections split back into three, which compute the same)."""
        if problem := adapter_problem(adapter):
            raise ValueError(problem)
        config = json.loads((adapter / CONFIG_FILE).read_text(encoding="utf-8"))
        if config.get("fine_tune_type", "lora") != "lora":
            raise ValueError(f"fine_tune_type {config['fine_tune_type']!r} is not supported")
        scale = float(config.get("lora_parameters", {}).get("scale", 20.0))
        weights = cast(dict[str, mx.array], mx.load(str(adapter / WEIGHTS_FILE)))  # safetensors
        with self._lock:
            split_fused_projections(self.model)  # an adapter names q, k and v apart
        pairs = self._pairs(weights)
        with self._lock:
            slot = len(self._scales)
            for path, (a, b) in pairs.items():
                if self.dtype is not None:
                    a, b = a.astype(self.dtype), b.astype(self.dtype)
                self._layer(path).add(slot, a, b)
            self._scales.append(scale)
        return slot

    def set_rows(self, slots: list[int]) -> None:
        """On the model thread, before a forward pass: each batch row's slot."""
        if not any(slots):
            self.rows.slots = self.rows.scales = None
            return
        self.rows.slots = mx.array(slots, dtype=mx.int32)
        self.rows.scales = mx.array([self._scales[s] for s in slots], dtype=mx.float32)

    def _pairs(self, weights: dict[str, mx.array]) -> dict[str, tuple[mx.array, mx.array]]:
        """(A, B) per adapted linear layer, checked against that layer's shape."""
        pairs = {}
        for name in sorted(weights):
            path, _, leaf = name.rpartition(".")
            if leaf == "lora_b" and f"{path}.lora_a" in weights:
                continue
            if leaf != "lora_a" or f"{path}.lora_b" not in weights:
                raise ValueError(f"{name}: not a LoRA tensor (lora_a/lora_b)")
            a, b = weights[name], weights[f"{path}.lora_b"]
            out_dim, in_dim = _linear_shape(_module(self.model, path))
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
                raise ValueError(f"{path}: lora_a {a.shape} and lora_b {b.shape} do not chain")
            if (a.shape[0], b.shape[1]) != (in_dim, out_dim):
                raise ValueError(
                    f"{path}: adapter maps {a.shape[0]} -> {b.shape[1]} but the layer maps "
                    f"{in_dim} -> {out_dim}"
                )
            pairs[path] = (a, b)
        if not pairs:
            raise ValueError("the adapter holds no LoRA tensors")
        return pairs

    def _layer(self, path: str) -> MultiLoRALinear:
        layer = self._layers.get(path)
        if layer is None:
            parent_path, _, key = path.rpartition(".")
            parent = _module(self.model, parent_path) if parent_path else self.model
            layer = MultiLoRALinear(getattr(parent, key), self.rows)
            setattr(parent, key, layer)
            self._layers[path] = layer
        return layer


def _module(model: nn.Module, path: str) -> Any:
    node: Any = model
    for part in path.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else getattr(node, part)
        except (AttributeError, IndexError, ValueError):
            raise ValueError(f"{path}: the model has no such layer") from None
    return node


def _linear_shape(layer: Any) -> tuple[int, int]:
    """(out, in) of a linear layer, quantized or not (or already carrying adapters)."""
    if isinstance(layer, MultiLoRALinear):
        layer = layer.linear
    if isinstance(layer, SplitLinear):
        layer = layer.packed_linear
    if isinstance(layer, PackedLinear):
        return layer.output_dims, layer.input_dims
    if isinstance(layer, nn.QuantizedLinear):
        out_dim, packed = layer.weight.shape
        return out_dim, packed * 32 // layer.bits
    if isinstance(layer, nn.Linear):
        out_dim, in_dim = layer.weight.shape
        return out_dim, in_dim
    raise ValueError(f"{type(layer).__name__} is not a linear layer")
