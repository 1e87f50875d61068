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


def test_the_int8_rounding_of_x_is_part_of_the_kv_identity(tmp_path: Path) -> None:
    """KV computed with x as one int8 term (cpu_activations: int8) is not the precise
    layout's, nor the float layout's; a float-layout model's identity is as it was."""
    import dataclasses

    from mlxd.models.cpu_path import Phases, Timings, decide

    (tmp_path / "model.safetensors").write_bytes(b"x" * 8)
    config = ModelConfig(source=str(tmp_path))
    timings = Timings((5.0, 6.0, 8.0, 100.0), (6.0, 8.0, 12.0, 150.0), (9.0, 15.0, 30.0, 200.0))
    float_layout = decide(
        Phases(prefill=256), timings, packed_bytes=1, float32_bytes=2, kv_bytes=0, budget=10
    )
    dot = dataclasses.replace(
        float_layout, timings=dataclasses.replace(timings, packed_dot=(1.0,) * 4)
    )
    one_term = dataclasses.replace(dot, precise=False)
    # Layers 4/4/4/100 in the float layout, 6/6/6/110 as int8 dot products; the head 1/2/4/0
    # and 0.5/1/2/0: the head alone runs them, and the KV (the layers') is the float layout's.
    head_only = dataclasses.replace(
        float_layout,
        timings=dataclasses.replace(
            timings,
            packed_dot=(6.5, 7.0, 8.0, 110.0),
            head_packed=(1.0, 2.0, 4.0, 0.0),
            head_dot=(0.5, 1.0, 2.0, 0.0),
        ),
    )
    assert head_only.head_dot and not head_only.dot
    identities = []
    for choice in (None, float_layout, dot, one_term, head_only):
        loaded = LoadedModel(
            nn.Module(), None, tmp_path, "q4", 0, {"model_type": "llama"}, cpu_path=choice
        )
        identities.append(kv_identity(config, loaded))
    assert identities[0] == identities[1] and "activations" not in identities[1]
    assert identities[2]["activations"] == "precise" and identities[3]["activations"] == "int8"
    assert identities[4] == identities[1]
