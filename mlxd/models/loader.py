"""Load a resolved model directory with mlx-lm, in the weight format the backend runs best.

Metal and CUDA have fast quantized kernels, so there the stored weights are kept. The MLX CPU
backend's own quantized matmul is slower than float32 BLAS; on the CPU a quantized model runs on
mlxd's packed kernel (models/packed.py: stored bits) when it is built and takes every layer,
and is dequantized to float32 otherwise. Which of the two is faster depends on the CPU and
the batch: given a `models.cpu_path.Choice` (timed at load), the loader packs, dequantizes,
or keeps both weight sets with each matmul on the faster for its row count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load, load_adapters

from mlxd import kernels
from mlxd.accel import backend_name
from mlxd.errors import ModelLoadError
from mlxd.kernels import Packed
from mlxd.models import fresh_weights
from mlxd.models.activations import use_rational_swiglu
from mlxd.models.adapters import adapter_problem
from mlxd.models.cpu_path import Choice
from mlxd.models.kernel_layers import (
    runs_kernel_attention,
    stores_half_kv,
    use_kernel_attention,
    use_kernel_layers,
)
from mlxd.models.layer_eval import evaluate_per_layer
from mlxd.models.packability import (
    can_pack,
    experts_summary,
    float32_summary,
    unpackable_layers,
)
from mlxd.models.packed import dequantize_layers, pack_model
from mlxd.models.packed_cache import Kept, PackedCache, keeps

log = logging.getLogger(__name__)

FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
DTYPES = ("auto", "keep", *FLOAT_DTYPES)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    path: Path
    dtype: str  # "float32" etc. after a cast; for kept weights e.g. "q4/q8" or "bfloat16"
    nbytes: int  # bytes of all parameters as loaded
    config: dict[str, Any]
    cpu_path: Choice | None = None  # the CPU path taken and the timings behind it
    # Quantized layers of a packed model the kernels do not take, run float32: name → why.
    float32_layers: dict[str, str] = field(default_factory=dict)
    experts: str = ""  # where quantized expert layers run (packed, MLX's quantized matmul), if any
    # What the KV cache stores: "float16" on the CPU kernel path (cache.kv_dtype), else the
    # compute dtype; None where that follows the stored weights (kept as stored).
    kv_dtype: str | None = None


def _target_dtype(dtype: str) -> str | None:
    """The float dtype to cast to, or None to keep the weights as stored."""
    if dtype == "auto":
        return "float32" if backend_name() == "cpu" else None
    return None if dtype == "keep" else dtype


def flat_parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters as (dotted name, array) pairs."""
    flat = tree_flatten(model.parameters())
    # tree_flatten returns a dict only when given one as `destination`.
    assert isinstance(flat, list)
    return flat


def _stored_dtype(model: nn.Module) -> str:
    """Describe weights kept as stored: quantized bit widths, else the dominant float dtype."""
    bits = sorted(
        {m.bits for _, m in model.named_modules() if isinstance(getattr(m, "bits", None), int)}
    )
    if bits:
        return "/".join(f"q{b}" for b in bits)
    sizes: dict[str, int] = {}
    for _, array in flat_parameters(model):
        if mx.issubdtype(array.dtype, mx.floating):
            name = str(array.dtype).removeprefix("mlx.core.")
            sizes[name] = sizes.get(name, 0) + array.nbytes
    return max(sizes, key=sizes.__getitem__)


def check_model_dir(path: Path, dtype: str, model_name: str) -> Path:
    """`path` as a Path once it is a directory and `dtype` is known; else ModelLoadError."""
    if dtype not in DTYPES:
        raise ModelLoadError(
            f"model '{model_name}': dtype {dtype!r} is not one of {', '.join(DTYPES)}"
        )
    path = Path(path)
    if not path.is_dir():
        # mlx-lm would take a missing path for a hub repo id and try to download it.
        raise ModelLoadError(f"model '{model_name}': model directory {path} does not exist")
    return path


def _with_adapter(model: nn.Module, adapter: Path, dtype: str | None, model_name: str) -> nn.Module:
    """`model` with the LoRA adapter at `adapter` applied, cast to `dtype` unless None."""
    try:
        # mlx-lm's own loader: it wraps the layers the adapter names in LoRA layers and
        # rejects tensors whose names or shapes do not fit this base model.
        model = load_adapters(model, str(adapter))
    except Exception as exc:  # a bad config raises KeyError, TypeError, ValueError…
        raise ModelLoadError(
            f"model '{model_name}': adapter {adapter} does not fit the model: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    model.eval()  # the new LoRA layers start in training mode (dropout on)
    if dtype is not None:
        model.set_dtype(FLOAT_DTYPES[dtype])
    return model


def _use_fresh(model: nn.Module, fresh: dict[str, mx.array]) -> None:
    """Put the arrays a conversion just wrote in place of the model's lazy ones of the same name,
    shape and dtype (the same values: the files hold them)."""
    current = dict(flat_parameters(model))
    same = [
        (name, array)
        for name, array in fresh.items()
        if (lazy := current.get(name)) is not None
        and (lazy.shape, lazy.dtype) == (array.shape, array.dtype)
    ]
    model.load_weights(same, strict=False)


def other_arrays(model: nn.Module, layers: dict[str, Packed]) -> dict[str, mx.array]:
    """The model's parameters that no packed layer holds and a packed file keeps (large ones:
    models/packed_cache.py), by parameter path; lazy where not yet evaluated."""
    packed = {id(array) for p in layers.values() for array in (p.weight, p.scale_bias)}
    return {
        name: array
        for name, array in flat_parameters(model)
        if id(array) not in packed and keeps(array)
    }


def take_others(
    model: nn.Module, layers: dict[str, Packed], kept: dict[str, mx.array]
) -> dict[str, mx.array]:
    """Put the `kept` arrays in place of the model's own others (`other_arrays`) where name,
    shape and dtype agree: mapped, never read or cast again. The model's others as they now
    are."""
    others = other_arrays(model, layers)
    same = {
        name: kept[name]
        for name, array in others.items()
        if name in kept and kept[name].shape == array.shape and kept[name].dtype == array.dtype
    }
    model.update(tree_unflatten(list(same.items())))
    return {**others, **same}


def _pack_model_kept(
    model: nn.Module,
    path: Path,
    model_name: str,
    path_for: Callable[[int], str] | None,
    dot: bool,
    precise: bool,
    cache_dir: Path | None,
    fresh: dict[str, Packed],
    head_dot: bool | None = None,
) -> None:
    """`pack_model`, taking the layers its conversion just packed (`fresh`) and those kept
    under `cache_dir`, and keeping them there for the next load when some did not come from
    there (models/packed_cache.py)."""
    if cache_dir is None:
        pack_model(model, path_for, dot, fresh, precise, head_dot=head_dot)
        return
    cache = PackedCache.for_model(cache_dir, path, dot, precise, head_dot)
    seen = cache.stamp()
    kept = cache.read() or Kept()
    cached = {**kept.layers, **fresh}
    fresh.clear()  # pack_model takes them out of `cached` as it uses them
    layers, _ = pack_model(model, path_for, dot, cached, precise, kept.others, head_dot)
    others = take_others(model, layers, kept.others)
    new = sum(1 for name, weights in layers.items() if kept.layers.get(name) is not weights)
    if new or any(kept.others.get(name) is not array for name, array in others.items()):
        log.info("model '%s': packed %d layers, keeping them in %s", model_name, new, cache.path)
        cache.write_in_background(Kept(layers, others), seen)


def load_llm(
    path: Path,
    *,
    dtype: str = "auto",
    model_name: str,
    adapter: Path | None = None,
    before_eval: Callable[[nn.Module, dict[str, Any]], nn.Module] | None = None,
    cpu_path: Choice | None = None,
    cache_dir: Path | None = None,
    kv_dtype: str = "auto",
) -> LoadedModel:
    """Load model and tokenizer from a local model dir (see sources.resolve_source).

    dtype: "auto" (on the CPU backend a quantized model packed for mlxd's kernels, else
    float32; as stored elsewhere), "keep", or a float dtype (quantized weights are dequantized
    first). `adapter`: a LoRA adapter directory in mlx-lm's
    format, applied on top in the same dtype. `before_eval(model, config)` may replace the
    model while its weights are still lazy (a distributed rank keeps only its shard, so only
    that part is ever read). `cpu_path`: for dtype auto on the CPU, packed, float32 or both
    (models/cpu_path.py; without one a packable model runs packed). `cache_dir`: where the
    packed layout is kept for the next load (models/packed_cache.py; None: packed every time).
    `kv_dtype`: the configured `cache.kv_dtype` (float16 is taken where `stores_half_kv`
    allows). Raises ModelLoadError naming `model_name`.
    """
    path = check_model_dir(path, dtype, model_name)
    if adapter is not None and (problem := adapter_problem(adapter)):
        raise ModelLoadError(f"model '{model_name}': {problem}")
    try:
        # Lazy: when casting, the stored weights are only read while computing the cast ones.
        loaded = load(str(path), lazy=True, return_config=True)
        # load's return type also covers return_config=False (no config).
        assert len(loaded) == 3
        model, tokenizer, config = loaded
        target = _target_dtype(dtype)
        # Distributed shards (before_eval) slice quantized layers with mlx-lm's own code,
        # which knows only its own layer types.
        packed = target == "float32" and dtype == "auto" and before_eval is None
        # The quantized layers the kernels do not take (every one of a 3-bit or mxfp4 model):
        # float32 on BLAS, as every layer is when the kernels take none.
        unpackable = unpackable_layers(model) if packed and kernels.available() else {}
        if unpackable:
            log.info("model '%s': %s", model_name, float32_summary(unpackable))
        packed = packed and can_pack(model)
        plan = (cpu_path.plan if cpu_path else "packed") if packed else None
        if plan is not None and cpu_path is not None:
            log.info("model '%s': %s", model_name, cpu_path.summary())
        packed = plan in ("packed", "mixed")
        # What this process just converted into `path`, if anything: packing then reads
        # memory, not the files just written (models/fresh_weights.py).
        fresh = fresh_weights.take(path)
        if not packed and target == "float32" and not kernels.available():
            log.warning(
                "model '%s': mlxd's CPU kernels are not built (python -m mlxd.kernels.build); "
                "running float32 on BLAS",
                model_name,
            )
        experts = experts_summary(model) if packed else ""
        if experts:
            log.info("model '%s': %s", model_name, experts)
        compute = "float32" if packed else target  # the activations' dtype (None: as stored)
        half_kv = stores_half_kv(runs_kernel_attention(model), compute, kv_dtype)
        if packed:
            _use_fresh(model, fresh.arrays)
            model.set_dtype(mx.float32)  # norms and scales: the kernel computes in float32
            target = None
            dequantize_layers(model, unpackable)
        elif target is not None:
            # Scales in float32 first: the CPU dequantizes ~3x faster from float32 than float16.
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
            model.set_dtype(FLOAT_DTYPES[target])
            config.pop("quantization", None)  # describe the weights as they now are
            config.pop("quantization_config", None)
        if adapter is not None:
            # mlx-lm's LoRA layers wrap the quantized layers, whose insides are packed next.
            model = _with_adapter(model, adapter, "float32" if packed else target, model_name)
        if packed:
            path_for = cpu_path.path_for if cpu_path and plan == "mixed" else None
            dot = cpu_path is not None and cpu_path.dot
            head_dot = cpu_path is not None and cpu_path.head_dot
            precise = cpu_path is None or cpu_path.precise
            # LoRA layers rename the layers they wrap: only a base model's are kept.
            kept = cache_dir if adapter is None else None
            _pack_model_kept(
                model, path, model_name, path_for, dot, precise, kept, fresh.packed, head_dot
            )
        if before_eval is not None:
            model = before_eval(model, config)
        # Private arrays too (Llama 3's scaled rope frequencies): one left lazy holds the
        # loading thread's stream, and the engine's thread cannot evaluate it.
        mx.eval(model.state)
        if backend_name() == "cpu":
            # The CPU backend evaluates exp element by element: the exact SiLU was ≈12% of a
            # batch-32 decode step on SmolLM2; the rational one is ≈10x cheaper (test_fast_silu).
            use_rational_swiglu(model)
            # One thread beside BLAS, or where one measured faster than all (a busy CPU).
            one_thread = cpu_path is not None and cpu_path.one_thread
            kernels.share_cores(plan == "packed" and not one_thread)
            # MLX composes rope, norms and attention from element-wise ops on the CPU.
            use_kernel_layers(model)
            use_kernel_attention(model, mx.float16 if half_kv else None)
            if packed:
                evaluate_per_layer(model)
            if packed and cpu_path is not None:
                kernels.set_spare_core_rows(1 if cpu_path.spares_a_core else 0)
                kernels.set_dot_buffer_rows(cpu_path.dot_buffer_rows)
    except ModelLoadError:
        raise
    except Exception as exc:  # mlx-lm raises whatever its parsers do: report them all as one kind
        raise ModelLoadError(
            f"model '{model_name}': cannot load {path}: {type(exc).__name__}: {exc}"
        ) from exc
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        dtype=(target or _stored_dtype(model)) + ("+float32" if plan == "mixed" else ""),
        nbytes=sum(array.nbytes for _, array in flat_parameters(model)),
        config=config,
        cpu_path=cpu_path if plan is not None else None,
        float32_layers=unpackable,
        experts=experts,
        kv_dtype="float16" if half_kv else compute,
    )
