"""RoPE, RMSNorm and attention through mlxd's CPU kernels: one pass each, not MLX's composition.

On the CPU backend MLX composes mx.fast.rope, mx.fast.rms_norm and
mx.fast.scaled_dot_product_attention from element-wise ops and BLAS calls: ≈50, 25 and 35 µs
for one decode token, per layer and call, more than the layer's matmuls once those run packed;
the kernels do the same arithmetic in a few µs (docs/performance.md). Only float32 inputs take
them; anything else (other dtypes, attention sinks, a quantized KV cache) goes to MLX as before.

Attention's keys and values may be float16: `KernelAttention` stores the KV cache in float16
where `stores_half_kv` says so (half the bytes of float32, as llama.cpp's default f16 cache),
and the kernel widens them as it reads.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import base
from mlx_lm.models.rope_utils import Llama3RoPE
from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

from mlxd import kernels
from mlxd.accel import backend_name
from mlxd.models.activations import RationalSwiGLU, is_swiglu_mlp
from mlxd.models.fused import fuse

# mlx-lm model modules (mlx_lm.models.<name>) whose attention is standard (see
# _standard_attention_classes); mistral and smollm2 load as llama.
STANDARD_ATTENTION_MODULES = ("llama", "qwen2", "qwen3")


class KernelRoPE(nn.Module):
    """A RoPE whose angles grow linearly with the position: a plain nn.RoPE, or Llama 3's
    scaled one (mlx-lm's Llama3RoPE: other frequencies, the same rotation). Inputs the kernel
    does not take go to the module it replaces."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.dims, self.traditional = rope.dims, rope.traditional
        if isinstance(rope, nn.RoPE):
            self.scale = rope.scale
            exponents = mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims
            self._inv_freq = mx.power(mx.array(rope.base, mx.float32), -exponents)
        else:
            self.scale = 1.0
            self._inv_freq = _angles_per_position(rope)
        self.replaced = rope
        # Now, on the loading thread: MLX streams belong to the thread that made them, and
        # the model runs on another.
        mx.eval(self._inv_freq)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.ndim != 4 or x.dtype != mx.float32:
            result: mx.array = self.replaced(x, offset=offset)
            return result
        return kernels.rope(
            x, self._inv_freq, _offsets(offset, x.shape[0]), self.dims, self.traditional, self.scale
        )

    def rotate_qkv(
        self, qkv: mx.array, offset: int | mx.array, heads: tuple[int, int], kv_dtype: mx.Dtype
    ) -> tuple[mx.array, mx.array, mx.array]:
        """A fused projection's float32 output [B, L, (H + 2 KV) * D] as q, k rotated as this
        rotates them, and v, each [B, heads, L, D]; k and v in `kv_dtype`. `heads`: (H, KV)."""
        return kernels.rope_qkv(
            qkv,
            self._inv_freq,
            _offsets(offset, qkv.shape[0]),
            heads,
            self.dims,
            self.traditional,
            self.scale,
            kv_dtype,
        )


def _angles_per_position(rope: nn.Module) -> mx.array:
    """Each frequency pair's angle per position, read off `rope` itself: (1, 0) in every pair
    rotated one position on is (cos, sin) of it (all in (0, 1] radians, so atan2 gives them
    to float32's precision). Its configuration then needs no second reading."""
    half = rope.dims // 2
    ones, zeros = mx.ones((half,)), mx.zeros((half,))
    if rope.traditional:  # pairs (2i, 2i + 1)
        pairs = mx.stack([ones, zeros], axis=-1).reshape(-1)
    else:  # pairs (i, i + half)
        pairs = mx.concatenate([ones, zeros])
    rotated = rope(pairs.reshape(1, 1, 1, -1), offset=1).reshape(-1)
    if rope.traditional:
        cos, sin = rotated[0::2], rotated[1::2]
    else:
        cos, sin = rotated[:half], rotated[half:]
    return mx.arctan2(sin, cos).astype(mx.float32)


def _offsets(offset: int | mx.array, batch: int) -> mx.array:
    """Each row's position offset as int32 [batch]. A batch cache's offsets already are (no
    broadcast node, two a layer otherwise); a plain int becomes a constant."""
    if isinstance(offset, mx.array):
        if offset.shape == (batch,) and offset.dtype == mx.int32:
            return offset
        return mx.broadcast_to(offset.astype(mx.int32), (batch,))
    return mx.array([offset] * batch, dtype=mx.int32)


class KernelRMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same weight) on the kernel for float32 inputs."""

    def __init__(self, norm: nn.RMSNorm) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        return kernels.rms_norm(x, self.weight, self.eps)


def use_kernel_layers(model: nn.Module) -> int:
    """Swap `model`'s plain nn.RoPE, Llama 3's RoPE and plain nn.RMSNorm layers for the kernel
    ones (subclasses and other variants keep MLX's); how many were swapped."""
    if not kernels.available():
        return 0
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if (type(module) is nn.RoPE and module.base is not None) or type(module) is Llama3RoPE:
            swaps.append((name, KernelRoPE(module)))
        elif type(module) is nn.RMSNorm:
            swaps.append((name, KernelRMSNorm(module)))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def kernel_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
    *,
    heads_last: bool = False,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` (models/base.py), on the kernel where it can:
    float32 queries, float32 or float16 keys and values. `heads_last`: the result as
    [B, L, H * D], what the output projection takes (the kernel writes it so: no transpose
    and copy after), else [B, H, L, D]."""
    quantized = hasattr(cache, "bits")  # a quantized KV cache: keys and values are tuples
    if (
        sinks is None
        and not quantized
        and queries.dtype == mx.float32
        and keys.dtype == values.dtype
        and keys.dtype in (mx.float32, mx.float16)
        and all(a.ndim == 4 for a in (queries, keys, values))
    ):
        return kernels.attention(queries, keys, values, scale, mask, heads_last)
    if not quantized and keys.dtype != queries.dtype:  # a float16 cache: MLX wants one dtype
        keys, values = keys.astype(queries.dtype), values.astype(queries.dtype)
    # mlx-lm passes "causal" as the mask too, which its annotation leaves out.
    result: mx.array = base.scaled_dot_product_attention(
        queries, keys, values, cache, scale=scale, mask=cast(Any, mask), sinks=sinks
    )
    if heads_last:
        B, H, L, D = result.shape
        return result.transpose(0, 2, 1, 3).reshape(B, L, H * D)
    return result


def _standard_attention_classes() -> tuple[type, ...]:
    """mlx-lm attention classes whose forward is exactly: q/k/v projections, (qwen3: a
    per-head RMSNorm of q and k,) RoPE at the cache's offset, the cache update,
    `scaled_dot_product_attention` and the output projection (read in their sources)."""
    return tuple(
        importlib.import_module(f"mlx_lm.models.{name}").Attention
        for name in STANDARD_ATTENTION_MODULES
    )


def has_kernel_attention(config: Mapping[str, Any]) -> bool:
    """Whether the mlx-lm model of `config` (config.json's) gets `KernelAttention` on the
    kernels' path (`use_kernel_attention`), which runs its packed q, k and v projections as one
    matmul (see `kernel_fusions`)."""
    return "qkv_proj" in kernel_fusions(config)


def kernel_fusions(config: Mapping[str, Any]) -> frozenset[str]:
    """The fusions of models/fused.py (`GROUPS`' names) the mlx-lm model of `config` gets on
    the kernels' path: "qkv_proj" where `KernelAttention` takes its attention, "gate_up_proj"
    where `RationalSwiGLU` takes its MLP. Asked of the model itself, built from `config` with
    its arrays never evaluated (≈15 ms and no memory for a 70B shape): types that wrap llama's
    or qwen's model under another name (smollm3, qwen2_vl, pixtral; mistral3 as its
    text_config says) get them as they load. A config mlx-lm cannot build gets none (its load
    fails anyway)."""
    return _built_fusions(json.dumps(dict(config), sort_keys=True, default=str))


@functools.lru_cache(maxsize=64)
def _built_fusions(config_json: str) -> frozenset[str]:
    config = json.loads(config_json)
    try:
        module = importlib.import_module(f"mlx_lm.models.{_module_name(config)}")
        model = module.Model(module.ModelArgs.from_dict(config))
    except Exception:  # whatever a config mlx-lm cannot build raises: nothing fuses
        return frozenset()
    swiglu = any(is_swiglu_mlp(layer) for _, layer in model.named_modules())
    return frozenset(
        name
        for name, runs in (("qkv_proj", runs_kernel_attention(model)), ("gate_up_proj", swiglu))
        if runs
    )


def _module_name(config: dict[str, Any]) -> str:
    """The mlx-lm module mlx-lm builds a config's model from: by its `architectures` where
    mlx-lm remaps those, else by its (remapped) model type, as mlx-lm's loader picks it."""
    model_type = str(config.get("model_type", ""))
    architectures = config.get("architectures") or ()
    for architecture in [architectures] if isinstance(architectures, str) else architectures:
        if (remapped := MODEL_ARCHITECTURE_REMAPPING.get((model_type, architecture))) is not None:
            return remapped
    return MODEL_REMAPPING.get(model_type, model_type)


def runs_kernel_attention(model: nn.Module) -> bool:
    """Whether `model` holds attention `use_kernel_attention` swaps for `KernelAttention`."""
    standard = _standard_attention_classes()
    return any(type(layer) in standard for _, layer in model.named_modules())


def stores_half_kv(kernel_attention: bool, compute_dtype: str | None, kv_dtype: str) -> bool:
    """Whether a model computing in `compute_dtype` keeps its KV cache in float16
    (`cache.kv_dtype`): on the CPU backend, where `KernelAttention` runs it on the kernel
    (`kernel_attention`: `has_kernel_attention` of its config) with float32 activations; with
    `auto`, where the kernels widen halves in hardware (every ISA variant but generic, whose
    software conversion made decode attention 4-12x slower: docs/performance.md). The loader
    and the memory estimate both ask."""
    return (
        kv_dtype != "float32"
        and compute_dtype == "float32"
        and backend_name() == "cpu"
        and kernels.available()
        and kernel_attention
        and (kv_dtype == "float16" or kernels.isa() != "generic")
    )


class KernelAttention(nn.Module):
    """A standard mlx-lm attention (the same projections, norms and RoPE, under the same
    parameter names) computing attention with `kernel_attention`; packed q, k and v projections
    run as one `qkv_proj` instead (models/fused.py) until `split_projections` gives them back.

    `eager`: schedule the layer's input (the previous layer's output, normed) for evaluation as
    soon as it is built. A forward pass is built in Python (≈2.5 ms for a SmolLM2 decode step)
    and evaluated on MLX's stream thread (≈10 ms), and `mx.async_eval` of a whole step returns
    only once all but its last ≈100 dispatches have run; scheduled layer by layer, the stream
    computes layer i while Python builds layer i + 1 (12.3–14.5 → 10.3–11.0 ms a SmolLM2
    batch-1 step, packed). The arithmetic is unchanged.

    `kv_dtype`: the dtype float32 keys and values are stored in the cache in (None: as
    computed); each cache takes the dtype of its first write, and a prefix cache's blocks
    that of the cache they were cut from.
    """

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = attention.n_heads, attention.n_kv_heads
        self.scale = attention.scale
        projections = [attention.q_proj, attention.k_proj, attention.v_proj]
        fused = fuse(projections)
        if fused is None:
            self.q_proj, self.k_proj, self.v_proj = projections
        else:
            self.qkv_proj = fused
        self.o_proj = attention.o_proj
        self.rope = attention.rope
        self.per_head_norm = "q_norm" in attention
        if self.per_head_norm:
            self.q_norm, self.k_norm = attention.q_norm, attention.k_norm
        self.eager = False
        self.kv_dtype: mx.Dtype | None = None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.eager:
            mx.async_eval(x)
        offset = 0 if cache is None else cache.offset
        rotated = self._project_rotated(x, offset, cache)
        if rotated is None:
            queries, keys, values = self._project_each(x, offset, cache)
        else:
            queries, keys, values = rotated
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        return self.o_proj(
            kernel_attention(queries, keys, values, cache, self.scale, mask, heads_last=True)
        )

    def _project_rotated(
        self, x: mx.array, offset: int | mx.array, cache: Any
    ) -> tuple[mx.array, mx.array, mx.array] | None:
        """q, k and v from the fused projection, split, rotated and cast in one kernel call
        (`kernels.rope_qkv`: one graph node where the steps of `_project_each` take twelve, of
        a layer's ≈31); None where that does not apply."""
        fused = self.get("qkv_proj")  # read once: split_projections may remove it meanwhile
        if (
            fused is None
            or self.per_head_norm
            or not isinstance(self.rope, KernelRoPE)
            or x.dtype != mx.float32
            or hasattr(cache, "bits")
        ):
            return None
        qkv = fused(x)  # float32: the kernel's output (a bias of another dtype promotes to it)
        stored = self._stored_dtype(cache) or mx.float32
        return self.rope.rotate_qkv(qkv, offset, (self.n_heads, self.n_kv_heads), stored)

    def _project_each(
        self, x: mx.array, offset: int | mx.array, cache: Any
    ) -> tuple[mx.array, mx.array, mx.array]:
        """q and k rotated, v, each [B, heads, L, D], step by step on MLX's ops."""
        B, L, _ = x.shape
        queries, keys, values = self._project(x)
        queries = queries.reshape(B, L, self.n_heads, -1)
        keys = keys.reshape(B, L, self.n_kv_heads, -1)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self.per_head_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        queries, keys = self.rope(queries, offset=offset), self.rope(keys, offset=offset)
        stored = self._stored_dtype(cache)
        if stored is not None and keys.dtype == mx.float32:
            keys, values = keys.astype(stored), values.astype(stored)
        return queries, keys, values

    def _stored_dtype(self, cache: Any) -> mx.Dtype | None:
        """The dtype float32 keys and values go into `cache` in (None: as computed): none
        without a cache, and a quantized cache rounds them itself."""
        if cache is None or hasattr(cache, "bits"):
            return None
        return self.kv_dtype

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # Read once: split_projections may remove it from another thread meanwhile.
        fused = self.get("qkv_proj")
        if fused is not None:
            queries, keys, values = fused.outputs(x)
            return queries, keys, values
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def split_projections(self) -> None:
        """q, k and v as layers of their own again. The separate layers are in place before
        the fused one goes, so a forward pass on another thread sees one or the other."""
        if "qkv_proj" in self:
            self.q_proj, self.k_proj, self.v_proj = self.qkv_proj.split()
            del self["qkv_proj"]


def split_fused_projections(model: nn.Module) -> None:
    """Every fused projection of `model` (q/k/v: KernelAttention; gate/up: RationalSwiGLU) as
    separate layers again: a LoRA adapter attaches to them by name."""
    for _, module in model.named_modules():
        if isinstance(module, (KernelAttention, RationalSwiGLU)):
            module.split_projections()


def use_kernel_attention(model: nn.Module, kv_dtype: mx.Dtype | None = None) -> int:
    """Replace `model`'s standard attention modules (llama, qwen2, qwen3) by `KernelAttention`
    holding the same layers, its KV cache stored in `kv_dtype` (None: as computed); how many.
    Other architectures keep mlx-lm's attention on MLX."""
    if not kernels.available():
        return 0
    standard = _standard_attention_classes()
    swaps = [
        (name, KernelAttention(module))
        for name, module in model.named_modules()
        if type(module) in standard
    ]
    for _, attention in swaps:
        attention.kv_dtype = kv_dtype
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)
