"""A worker's first load of a GGUF packs the arrays its conversion just wrote, from memory: the
directory's files are not read back (models/fresh_weights.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from mlxd import host_memory
from mlxd.models import fresh_weights
from mlxd.models.gguf import convert_gguf
from mlxd.models.loader import load_llm
from mlxd.models.sources import resolve_source
from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf

PROMPT = mx.array([[1, 5, 9, 14]])


def _logits(model_dir: Path) -> np.ndarray:
    loaded = load_llm(model_dir, model_name="tiny")  # the CPU's packed path: dtype auto
    assert "q8" in loaded.dtype  # the quantized layers ran packed
    return np.array(loaded.model(PROMPT))


def _scribble(model_dir: Path) -> None:
    """Every tensor's bytes in the directory's safetensors files overwritten, headers kept."""
    for file in model_dir.glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        start = 8 + int.from_bytes(data[:8], "little")
        noise = np.random.default_rng(0).integers(0, 256, len(data) - start, dtype=np.uint8)
        data[start:] = noise.tobytes()
        file.write_bytes(bytes(data))


def test_a_load_packs_what_this_process_just_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fresh_weights, "room_to_hold", lambda: True)  # whatever this machine has
    config = tiny_config("llama", num_hidden_layers=1)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, config, tiny_weights(config), Q.Q8_0)
    reference = _logits(resolve_source(str(gguf), model_name="tiny", cache_dir=tmp_path / "a"))
    model_dir = resolve_source(str(gguf), model_name="tiny", cache_dir=tmp_path / "b")
    _scribble(model_dir)
    np.testing.assert_array_equal(_logits(model_dir), reference)
    # Taken once: the next load reads the files, scribbles and all.
    assert fresh_weights.take(model_dir) == {}
    assert not np.array_equal(_logits(model_dir), reference)


def test_held_arrays_are_for_their_directory_only(tmp_path: Path) -> None:
    fresh_weights.hold(tmp_path / "a", {"w": mx.zeros(2)})
    assert fresh_weights.take(tmp_path / "b") == {}
    assert list(fresh_weights.take(tmp_path / "a")) == ["w"]
    assert fresh_weights.take(tmp_path / "a") == {}


def test_a_conversion_holds_arrays_only_with_a_quarter_of_memory_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 2**30
    monkeypatch.setattr(host_memory, "memory", lambda: host_memory.Memory(24 * gib, 7 * gib))
    assert fresh_weights.room_to_hold()
    monkeypatch.setattr(host_memory, "memory", lambda: host_memory.Memory(24 * gib, 5 * gib))
    assert not fresh_weights.room_to_hold()
    config = tiny_config("llama", num_hidden_layers=1)
    write_gguf(tmp_path / "tiny.gguf", config, tiny_weights(config), Q.Q8_0)
    (tmp_path / "out").mkdir()
    assert convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out") == {}
