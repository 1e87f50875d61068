"""A worker's first load of a GGUF packs the arrays its conversion just wrote, from memory, or
takes the matrices the conversion packed for it: the directory's files are not read back
(models/fresh_weights.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from mlx_lm.utils import load_model

from mlxd import host_memory
from mlxd.models import fresh_weights, packed, packed_cache
from mlxd.models.fresh_weights import Fresh, PackLayout
from mlxd.models.gguf import convert_gguf
from mlxd.models.groups import fused_groups, is_one_matrix
from mlxd.models.loader import load_llm
from mlxd.models.packability import quantized_layers, why_layer_not_packable
from mlxd.models.packed import fits, pack
from mlxd.models.sources import resolve_source
from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf

PROMPT = mx.array([[1, 5, 9, 14]])


def _logits(model_dir: Path, cache_dir: Path | None = None) -> np.ndarray:
    # The CPU's packed path (dtype auto): the float layout, x exact (no CPU path given).
    loaded = load_llm(model_dir, model_name="tiny", cache_dir=cache_dir)
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
    assert fresh_weights.take(model_dir) == Fresh()
    assert not np.array_equal(_logits(model_dir), reference)


LAYOUTS = [
    PackLayout(dot=False, precise=True),
    PackLayout(True, True),
    PackLayout(True, False),
    PackLayout(True, True, head_dot=False),  # the head in the float layout, apart
]


@pytest.mark.parametrize(
    ("model_type", "qtype"),
    [("llama", Q.Q4_K), ("llama", Q.Q6_K), ("gemma3_text", Q.Q4_0), ("qwen3_moe", Q.Q8_0)],
)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["float", "dot-precise", "dot", "head-float"])
def test_a_conversion_packs_every_matrix_as_its_load_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str, qtype: Q, layout: PackLayout
) -> None:
    monkeypatch.setattr(fresh_weights, "room_to_hold", lambda: True)
    config = tiny_config(model_type, hidden_size=256, intermediate_size=512)
    if "moe_intermediate_size" in config:
        config["moe_intermediate_size"] = 256
    write_gguf(tmp_path / "tiny.gguf", config, tiny_weights(config), qtype)
    with fresh_weights.packing(layout):
        model_dir = resolve_source(
            str(tmp_path / "tiny.gguf"), model_name="tiny", cache_dir=tmp_path
        )
    fresh = fresh_weights.take(model_dir)
    model, _ = load_model(model_dir)
    model.set_dtype(mx.float32)  # as the loader does before it packs
    # The linears the load would pack (not a tied embedding, nor the experts: it packs those).
    linears = {
        name: module
        for name, module in quantized_layers(model).items()
        if isinstance(module, nn.QuantizedLinear) and why_layer_not_packable(module) is None
    }
    assert linears and set(fresh.packed) == set(linears)
    for name, early in fresh.packed.items():
        module = linears[name]
        head = name == "lm_head" and layout.head_dot is not None
        dot = layout.head_dot if head else layout.dot
        assert fits(early, module, bool(dot), layout.precise)
        bits, group = module.bits, module.group_size
        again = pack(module.weight, module.scales, module.biases, group, bits, dot, layout.precise)
        np.testing.assert_array_equal(np.array(early.weight), np.array(again.weight))
        np.testing.assert_array_equal(np.array(early.scale_bias), np.array(again.scale_bias))
        assert f"{name}.weight" not in fresh.arrays  # held once: packed
    assert "model.embed_tokens.weight" in fresh.arrays
    # Each group the load fuses (q, k and v; gate and up) packed as one matrix's rows, as it
    # completed: fusing it copies nothing.
    groups = fused_groups(fresh.packed)
    assert any(name.endswith("qkv_proj") for name in groups)
    assert all(is_one_matrix([fresh.packed[part] for part in parts]) for parts in groups.values())


def _not_again(*args: object) -> None:
    raise AssertionError("a matrix its conversion packed was packed again")


def test_a_first_load_takes_what_its_conversion_packed_and_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fresh_weights, "room_to_hold", lambda: True)
    config = tiny_config("llama", hidden_size=256, intermediate_size=512)
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, config, tiny_weights(config), Q.Q4_K)
    reference = _logits(resolve_source(str(gguf), model_name="tiny", cache_dir=tmp_path / "a"))
    cache_dir = tmp_path / "b"
    with fresh_weights.packing(LAYOUTS[0]):  # what load_llm without a CPU path runs
        model_dir = resolve_source(str(gguf), model_name="tiny", cache_dir=cache_dir)
    # Nothing packed again: the load takes every matrix its conversion packed.
    with monkeypatch.context() as patch, caplog.at_level("INFO", logger="mlxd.models.loader"):
        patch.setattr(packed, "_pack", _not_again)
        np.testing.assert_array_equal(_logits(model_dir, cache_dir), reference)
    assert "packed 15 layers, keeping them" in caplog.text  # 7 matrices a layer and the head
    # Kept for the next load, which maps them from there and packs none.
    packed_cache.wait_for_writes()
    caplog.clear()
    with caplog.at_level("INFO", logger="mlxd.models.loader"):
        np.testing.assert_array_equal(_logits(model_dir, cache_dir), reference)
    assert "packed" not in caplog.text


def test_held_arrays_are_for_their_directory_only(tmp_path: Path) -> None:
    fresh_weights.hold(tmp_path / "a", Fresh({"w": mx.zeros(2)}))
    assert fresh_weights.take(tmp_path / "b") == Fresh()
    assert list(fresh_weights.take(tmp_path / "a").arrays) == ["w"]
    assert fresh_weights.take(tmp_path / "a") == Fresh()


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
    with fresh_weights.packing(LAYOUTS[0]):  # nor anything packed
        assert convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out") == Fresh()
