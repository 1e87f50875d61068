"""Which of a model's quantized layers mlxd's CPU kernels take (models/packed.py packs those),
and the report of the others for the log and status: the kernels take affine matrices of some
widths and shapes; a layer they do not take runs float32 on BLAS (a linear, an embedding) or
on MLX's own quantized matmul (a mixture of experts' stack)."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from mlxd import kernels
from mlxd.kernels import KERNEL_BITS

Quantized = nn.QuantizedLinear | nn.QuantizedEmbedding | QuantizedSwitchLinear


def why_not_packable(rows: int, group_size: int, bits: int) -> str | None:
    """What keeps the kernels from an affine matrix of this shape and width (None: nothing)."""
    if bits not in KERNEL_BITS:
        return f"{bits}-bit (the kernels take 2 to 6 and 8)"
    return kernels.why_not_packable(rows, group_size, KERNEL_BITS[bits])


def why_layer_not_packable(module: Quantized) -> str | None:
    """What keeps the kernels from this quantized layer (None: nothing)."""
    if module.mode != "affine":
        return f"{module.mode} quantization (the kernels take affine)"
    # Output rows: a matrix's, or each expert's of a stack [E, N, K * bits / 32].
    return why_not_packable(module.weight.shape[-2], module.group_size, module.bits)


def is_lm_head(path: str) -> bool:
    """Whether a module path names a separate output head: `lm_head`, at the top or a level down
    in a wrapper (mlx-vlm's `language_model.lm_head`)."""
    return path.rsplit(".", 1)[-1] == "lm_head"


def has_own_head(module_paths: Iterable[str]) -> bool:
    """Whether a model with these module paths has a separate output head (untied)."""
    return any(is_lm_head(path) for path in module_paths)


def quantized_layers(model: nn.Module) -> dict[str, nn.QuantizedLinear | nn.QuantizedEmbedding]:
    """The quantized layers that multiply: linears, and an embedding that is also the output
    projection (tied: mlx-lm's models have an `lm_head` exactly when theirs is separate). An
    untied embedding only looks rows up, which MLX does as well from its stored table."""
    tied = not has_own_head(name for name, _ in model.named_modules())
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.QuantizedLinear)
        or (tied and isinstance(module, nn.QuantizedEmbedding))
    }


def can_pack(model: nn.Module) -> bool:
    """Whether the kernels are built and take some quantized layer of `model`."""
    quantized = quantized_layers(model).values()
    return kernels.available() and any(why_layer_not_packable(m) is None for m in quantized)


def unpackable_layers(model: nn.Module) -> dict[str, str]:
    """The quantized layers the kernels do not take, and why."""
    return {
        name: why
        for name, module in quantized_layers(model).items()
        if (why := why_layer_not_packable(module)) is not None
    }


def expert_stacks(model: nn.Module) -> dict[str, QuantizedSwitchLinear]:
    """A mixture of experts' quantized stacks of expert matrices."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, QuantizedSwitchLinear)
    }


def experts_summary(model: nn.Module) -> str:
    """Where the quantized layers of kinds other than linears and embeddings run (mlx-lm's
    `QuantizedSwitchLinear`: a mixture of experts' stacked expert matrices), as `pack_model`
    will place them: "" for none, else a line for the log and status."""
    unpackable: dict[str, str] = {}
    packable = 0
    for name, module in model.named_modules():
        if "scales" not in module or isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        if not isinstance(module, QuantizedSwitchLinear):
            unpackable[name] = f"{type(module).__name__} (the kernels take mlx-lm's switch layers)"
        elif (why := why_layer_not_packable(module)) is not None:
            unpackable[name] = why
        else:
            packable += 1
    lines = []
    if packable:
        lines.append(f"{packable} quantized expert layers run packed on the kernels' gather matmul")
    if unpackable:
        lines.append(
            f"{len(unpackable)} quantized expert layers run on MLX's own quantized matmul, the "
            f"kernels do not take them: {_by_reason(unpackable)}"
        )
    return "; ".join(lines)


def _by_reason(unpackable: dict[str, str]) -> str:
    """Layer names grouped by why, a few of each: "6-bit (...): lm_head, …; ..."."""
    by_reason: dict[str, list[str]] = {}
    for name, why in unpackable.items():
        by_reason.setdefault(why, []).append(name)
    return "; ".join(
        f"{why}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
        for why, names in by_reason.items()
    )


def float32_summary(unpackable: dict[str, str]) -> str:
    """For the log and status ("" for none), e.g. "2 quantized layers run float32 on BLAS,
    the kernels do not take them: 6-bit (the kernels take 4 and 8): lm_head, …"."""
    count = len(unpackable)
    if not count:
        return ""
    layers = "layer runs" if count == 1 else "layers run"
    return (
        f"{count} quantized {layers} float32 on BLAS, the kernels do not take them: "
        f"{_by_reason(unpackable)}"
    )
