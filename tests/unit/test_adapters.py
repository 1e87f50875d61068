"""An adapter's KV is not its base model's: the prefix cache identity tells them apart, and
adding the key for adapters leaves every base model's identity (and its SSD blocks) as it was."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn

from mlxd.config import ModelConfig
from mlxd.models.loader import LoadedModel
from mlxd.worker.llm_load import kv_identity


def test_the_adapter_and_its_weights_are_part_of_the_kv_identity(tmp_path: Path) -> None:
    base_dir, adapter = tmp_path / "base", tmp_path / "adapter"
    for directory, name in ((base_dir, "model.safetensors"), (adapter, "adapters.safetensors")):
        directory.mkdir()
        (directory / name).write_bytes(b"x" * 8)
    loaded = LoadedModel(nn.Module(), None, base_dir, "float32", 0, {"model_type": "llama"})
    base = ModelConfig(source=str(base_dir))
    tuned = ModelConfig(source=str(base_dir), adapter=adapter)

    assert "adapter" not in kv_identity(base, loaded)
    first = kv_identity(tuned, loaded)
    assert {k: v for k, v in first.items() if k != "adapter"} == kv_identity(base, loaded)
    assert first["adapter"]["path"] == str(adapter)
    (adapter / "adapters.safetensors").write_bytes(b"y" * 16)  # retrained in place
    assert kv_identity(tuned, loaded) != first
