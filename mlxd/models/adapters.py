"""LoRA adapters in mlx-lm's format (what `mlx_lm.lora` writes): a directory holding
adapter_config.json and adapters.safetensors. Checked here without loading any weights, so
`mlxd check` and a load report the same problems."""

from __future__ import annotations

import json
from pathlib import Path

from mlxd.config import Config
from mlxd.config.loader import Loc

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"


def adapter_problem(path: Path) -> str | None:
    """What keeps `path` from being an adapter directory, or None if nothing does."""
    if not path.is_dir():
        return f"adapter directory {path} does not exist"
    if not (path / WEIGHTS_FILE).is_file():
        return f"adapter directory {path} has no {WEIGHTS_FILE}"
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"adapter directory {path} has no {CONFIG_FILE}"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"cannot read {path / CONFIG_FILE}: {exc}"
    if not isinstance(config, dict):
        return f"{path / CONFIG_FILE} is not a JSON object"
    return None


def adapter_bytes(path: Path) -> int:
    """The adapter's weights as stored (LoRA matrices are small: no dtype arithmetic); 0 for
    a directory without them, which its load then reports."""
    try:
        return (path / WEIGHTS_FILE).stat().st_size
    except OSError:
        return 0


def check_adapters(config: Config) -> list[tuple[Loc, str]]:
    """`mlxd check`'s look at every model's `adapter:` directory (loader.ExtraCheck)."""
    problems: list[tuple[Loc, str]] = []
    for name, model in config.models.items():
        if model.adapter is not None and (problem := adapter_problem(model.adapter)):
            problems.append((("models", name, "adapter"), problem))
    return problems
