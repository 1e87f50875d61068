"""The kernels' packed layout kept under cache_dir (models/packed_cache.py): a second load reads it
instead of repacking and computes exactly what a fresh pack does; a changed key repacks; an
unreadable file falls back to packing (issue 26: a cached load should be a read)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as Q

from mlxd.models.packed_cache import FORMAT, read_arrays, write_arrays
from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf
from tests.unit.test_kernels import _greedy

PROMPT = mx.array([[1, 5, 9, 42, 7]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF converted as the loader finds it: tied embedding (packed too), Q4_0."""
    from mlxd import kernels
    from mlxd.models.gguf import convert_gguf

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    root = tmp_path_factory.mktemp("packed-cache")
    config = tiny_config(
        "llama", hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=True
    )
    write_gguf(root / "m.gguf", config, tiny_weights(config), Q.Q4_0)
    (root / "model").mkdir()
    convert_gguf(root / "m.gguf", root / "model")
    return root / "model"


class Packings:
    """Counts the layers packed (rather than read from the cache) while it is installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlxd.models import packed

        self.count = 0
        original = packed._pack

        def counted(*args: Any) -> Any:
            self.count += 1
            return original(*args)

        monkeypatch.setattr(packed, "_pack", counted)


def _load(model_dir: Path, cache_dir: Path | None, cpu_path: Any = None) -> Any:
    from mlxd.models.loader import load_llm
    from mlxd.models.packed_cache import wait_for_writes

    loaded = load_llm(model_dir, model_name="m", cache_dir=cache_dir, cpu_path=cpu_path)
    wait_for_writes()  # the file is written beside the model's first requests
    return loaded


def _files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "packed").glob("*/*.packed"))


def _rewrite(path: Path, arrays: dict[str, mx.array], header: dict[str, Any]) -> None:
    """Replace the file at `path` as the cache does (a new file renamed over it): the arrays
    may be mapped from it, and a file truncated under its mapping would fault their reads."""
    mx.eval(list(arrays.values()))
    write_arrays(path.with_suffix(".new"), arrays, header)
    path.with_suffix(".new").replace(path)


def _mapped(path: Path) -> bool:
    return any(line.rstrip().endswith(str(path)) for line in open("/proc/self/maps"))


def _dot_choice() -> Any:
    """A CPU path that runs every phase packed with the int8 dot-product layout."""
    from mlxd.models.cpu_path import Choice, Phases, Timings

    fast = (1.0, 2.0, 3.0, 40.0)
    timings = Timings(fast, (2.0, 4.0, 6.0, 80.0), (9.0, 9.0, 9.0, 90.0), (0.5, 1.0, 1.5, 20.0))
    phases = Phases(prefill=16)
    choice = Choice("packed", ("packed",) * 4, phases, timings, 0)
    assert choice.dot
    return choice


def test_the_second_load_reads_the_packed_layers_and_computes_the_same(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    fresh = _load(model_dir, None)  # packed here, nothing kept
    packings = Packings(monkeypatch)
    first = _load(model_dir, tmp_path)
    packed_layers = packings.count
    assert packed_layers > 0 and len(_files(tmp_path)) == 1
    packings.count = 0
    second = _load(model_dir, tmp_path)
    assert packings.count == 0  # every layer read from the file
    expected = fresh.model(PROMPT)
    for loaded in (first, second):
        assert mx.array_equal(loaded.model(PROMPT), expected).item()
        assert _greedy(loaded.model, PROMPT, 8) == _greedy(fresh.model, PROMPT, 8)
    assert second.nbytes == fresh.nbytes
    # The tied embedding looks rows up from the packed table it read.
    assert mx.array_equal(
        second.model.model.embed_tokens(PROMPT), fresh.model.model.embed_tokens(PROMPT)
    ).item()


def test_a_cached_load_maps_the_file_until_the_model_goes(model_dir: Path, tmp_path: Path):
    import gc

    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    loaded = _load(model_dir, tmp_path)
    assert _mapped(kept)  # the weights are the file's pages, not copies
    del loaded
    gc.collect()
    assert not _mapped(kept)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.rstrip().endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _in_file(array: mx.array, path: Path) -> bool:
    from mlxd import kernels

    address = kernels.numpy_view(array).__array_interface__["data"][0]
    return any(start <= address < end for start, end in _mapped_ranges(path))


def test_a_layers_q_k_and_v_are_kept_as_one_and_fused_without_a_copy(
    model_dir: Path, tmp_path: Path
):
    fresh = _load(model_dir, None)
    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    header = read_arrays(kept)[1]
    layers = {name.split(".")[2] for name in header["fused"]}
    assert len(layers) == fresh.config["num_hidden_layers"]  # every layer's, as one matrix
    loaded = _load(model_dir, tmp_path)
    for layer in loaded.model.model.layers:
        fused = layer.self_attn.qkv_proj
        assert _in_file(fused.weight, kept) and _in_file(fused.scale_bias, kept)  # its pages
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF whose embedding is its own (untied): looked up, never packed."""
    from mlxd.models.gguf import convert_gguf

    root = tmp_path_factory.mktemp("packed-cache-untied")
    config = tiny_config("llama", hidden_size=128, intermediate_size=256, head_dim=32)
    write_gguf(root / "m.gguf", config, tiny_weights(config), Q.Q4_0)
    (root / "model").mkdir()
    convert_gguf(root / "m.gguf", root / "model")
    return root / "model"


def test_the_other_arrays_are_kept_and_mapped_as_the_load_made_them(
    untied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from mlxd.models import packed_cache

    monkeypatch.setattr(packed_cache, "OTHERS_MIN_BYTES", 1)  # a tiny model's: every one
    fresh = _load(untied_dir, None)
    _load(untied_dir, tmp_path)
    (kept,) = _files(tmp_path)
    others = read_arrays(kept)[1]["others"]
    embedding = ["model.embed_tokens.weight", "model.embed_tokens.scales"]
    assert set(embedding) | {"model.norm.weight"} <= set(others)
    assert not any(name.endswith("proj.weight") for name in others)  # those are packed
    loaded = _load(untied_dir, tmp_path)
    table = loaded.model.model.embed_tokens
    assert table.scales.dtype == mx.float32  # as the load cast them, not as stored
    assert all(_in_file(table[name.rsplit(".", 1)[1]], kept) for name in embedding)
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()
    assert _greedy(loaded.model, PROMPT, 8) == _greedy(fresh.model, PROMPT, 8)


def test_a_kept_array_that_does_not_fit_its_parameter_is_not_taken(
    untied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from mlxd.models import packed_cache

    monkeypatch.setattr(packed_cache, "OTHERS_MIN_BYTES", 1)
    fresh = _load(untied_dir, None)
    _load(untied_dir, tmp_path)
    (kept,) = _files(tmp_path)
    arrays, header = read_arrays(kept)
    name = "model.embed_tokens.scales:other"
    arrays[name] = arrays[name][:-1].astype(mx.float16)  # another shape and dtype
    _rewrite(kept, arrays, header)
    del arrays
    loaded = _load(untied_dir, tmp_path)  # the model's own, and the file written again
    assert not _in_file(loaded.model.model.embed_tokens.scales, kept)
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()
    again = _load(untied_dir, tmp_path)
    assert _in_file(again.model.model.embed_tokens.scales, kept)


@pytest.mark.parametrize("weights", ["untied_dir", "model_dir"])  # lm_head, or the embedding
def test_a_mixed_plans_float32_weights_are_kept_and_not_dequantized_again(
    weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
):
    from mlxd.models import packed_cache
    from mlxd.models.cpu_path import Choice, Phases, Timings
    from mlxd.models.packed import SplitLinear

    monkeypatch.setattr(packed_cache, "OTHERS_MIN_BYTES", 1)
    # Packed decode, float32 prefill (over 32 rows): both weight sets held.
    timings = Timings((4.0, 6.0, 9.0, 900.0), (5.0, 7.0, 11.0, 950.0), (9.0, 15.0, 30.0, 200.0))
    mixed = Choice("mixed", ("packed", "packed", "packed", "float32"), Phases(64), timings, 0)
    prompt = mx.arange(40).reshape(1, 40)  # on the float32 weights
    model_dir = request.getfixturevalue(weights)
    fresh = _load(model_dir, None, mixed)
    _load(model_dir, tmp_path, mixed)
    (kept,) = _files(tmp_path)
    dequantized = 0
    original = mx.dequantize

    def counted(*args: Any, **kwargs: Any) -> mx.array:
        nonlocal dequantized
        dequantized += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(mx, "dequantize", counted)
    loaded = _load(model_dir, tmp_path, mixed)
    assert dequantized == 0
    split = [m for _, m in loaded.model.named_modules() if isinstance(m, SplitLinear)]
    assert split and all(_in_file(m.dense, kept) for m in split)
    for tokens in (PROMPT, prompt):
        assert mx.array_equal(loaded.model(tokens), fresh.model(tokens)).item()


def test_writing_into_a_mapped_array_leaves_the_file_as_it_is(tmp_path: Path):
    from mlxd import kernels

    path = tmp_path / "a.packed"
    write_arrays(path, {"a": mx.arange(1000, dtype=mx.float32)}, {"format": FORMAT})
    before = path.read_bytes()
    # An input MLX holds alone: it donates only buffers it allocated, so the result is new.
    doubled = read_arrays(path)[0]["a"] * 2
    assert mx.array_equal(doubled, mx.arange(1000, dtype=mx.float32) * 2).item()
    (array,) = read_arrays(path)[0].values()
    kernels.numpy_view(array)[:] = 7  # copy-on-write: this process's pages only
    assert mx.all(array == 7).item()
    assert path.read_bytes() == before
    assert mx.array_equal(read_arrays(path)[0]["a"], mx.arange(1000, dtype=mx.float32)).item()


def test_a_file_renamed_over_the_path_while_it_is_read_is_not_mixed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from mlxd import kernels
    from mlxd.models import packed_cache

    path, other = tmp_path / "a.packed", tmp_path / "b.packed"
    write_arrays(path, {"a": mx.arange(1000, dtype=mx.float32)}, {"format": FORMAT})
    # Another layout: the same name elsewhere in a longer file, other values.
    room = {"room": " " * 200}
    write_arrays(other, {"a": mx.full((1000,), 5.0)}, {"format": FORMAT, **room})
    mapping = kernels.map_arrays

    def replaced_first(*args: Any) -> Any:
        other.replace(path)  # a writer's rename between the header and the mapping
        return mapping(*args)

    monkeypatch.setattr(packed_cache.kernels, "map_arrays", replaced_first)
    arrays, _ = read_arrays(path)
    assert mx.array_equal(arrays["a"], mx.arange(1000, dtype=mx.float32)).item()


def test_a_file_another_process_wrote_meanwhile_stands(model_dir: Path, tmp_path: Path):
    from mlxd.models.packed_cache import PackedCache

    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    cache = PackedCache(kept)
    stamp = cache.stamp()
    header = read_arrays(kept)[1]
    layers = cache.read()
    assert layers is not None
    # This load found no file, packed, and another process wrote one meanwhile: it stands.
    cache.write(layers, None)
    assert cache.stamp() == stamp
    # This load read that very file (one missing layers, say): its write replaces it.
    cache.write(layers, stamp)
    assert cache.stamp() != stamp
    assert read_arrays(kept)[1] == header


def test_another_layout_repacks_and_replaces_the_kept_one(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _load(model_dir, tmp_path)
    (float_layout,) = _files(tmp_path)
    packings = Packings(monkeypatch)
    dot = _load(model_dir, tmp_path, _dot_choice())
    assert packings.count > 0
    (dot_layout,) = _files(tmp_path)  # one packed copy per model
    assert dot_layout != float_layout and dot_layout.parent == float_layout.parent
    reference = _load(model_dir, None, _dot_choice())
    packings.count = 0
    again = _load(model_dir, tmp_path, _dot_choice())
    assert packings.count == 0
    assert mx.array_equal(again.model(PROMPT), reference.model(PROMPT)).item()
    assert mx.array_equal(dot.model(PROMPT), reference.model(PROMPT)).item()


def test_rewritten_weights_are_packed_again(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    import shutil

    copy = shutil.copytree(model_dir, tmp_path / "model")
    _load(copy, tmp_path / "cache")
    packings = Packings(monkeypatch)
    config = copy / "config.json"
    stat = config.stat()
    config.write_text(config.read_text())  # same bytes, rewritten: not trusted
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    _load(copy, tmp_path / "cache")
    assert packings.count > 0
    assert len(_files(tmp_path / "cache")) == 1  # the copy for the old files is gone


def test_a_file_missing_some_layers_is_completed(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    fresh = _load(model_dir, None)
    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    arrays, header = read_arrays(kept)
    layers, fused = header["layers"], header["fused"]
    in_groups = {part for parts in fused.values() for part, _ in parts}
    dropped = sorted(set(layers) - in_groups)[::2]
    for name in dropped:
        del layers[name], arrays[f"{name}.weight"], arrays[f"{name}.scale_bias"]
    # And one layer's q, k and v, kept as one matrix.
    whole, parts = sorted(fused.items())[0]
    del fused[whole], arrays[f"{whole}.weight"], arrays[f"{whole}.scale_bias"]
    for part, _ in parts:
        del layers[part]
        dropped.append(part)
    _rewrite(kept, arrays, header)
    del arrays
    packings = Packings(monkeypatch)
    # The rest is read, and kept again with the repacked ones by the writing thread.
    loaded = _load(model_dir, tmp_path)
    assert packings.count == len(dropped)
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()
    packings.count = 0
    _load(model_dir, tmp_path)
    assert packings.count == 0


def test_the_process_waits_for_the_write_before_it_exits(model_dir: Path, tmp_path: Path):
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from mlxd.models import packed_cache\n"
        "from mlxd.models.loader import load_llm\n"
        "from mlxd.process_exit import exit_process\n"
        "write = packed_cache.write_arrays\n"
        "packed_cache.write_arrays = lambda *a: (time.sleep(2), write(*a))  # a slow disk\n"
        "load_llm(Path(sys.argv[1]), model_name='m', cache_dir=Path(sys.argv[2]))\n"
        "exit_process(0)\n"
    )
    command = [sys.executable, "-c", script, str(model_dir), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    (kept,) = _files(tmp_path)
    arrays, _ = read_arrays(kept)  # whole: every array is checked against the file's size
    assert len(arrays) > 0


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "foreign"])
def test_an_unreadable_cache_falls_back_to_packing(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
):
    fresh = _load(model_dir, None)
    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    if damage == "truncated":
        os.truncate(kept, kept.stat().st_size * 2 // 3)
    elif damage == "empty":
        kept.write_bytes(b"")
    elif damage == "garbage":
        kept.write_bytes(os.urandom(4096))
    else:  # a valid file with other arrays under the layers' names
        arrays, header = read_arrays(kept)
        _rewrite(kept, {k: mx.contiguous(v[:16]) for k, v in arrays.items()}, header)
    packings = Packings(monkeypatch)
    loaded = _load(model_dir, tmp_path)
    assert packings.count > 0
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()
    # Kept again, whole: the next load reads it.
    packings.count = 0
    _load(model_dir, tmp_path)
    assert packings.count == 0


def test_a_cache_that_cannot_be_written_costs_only_the_next_load(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "packed").write_text("a file where the folder would go")
    fresh = _load(model_dir, None)
    loaded = _load(model_dir, tmp_path)
    assert mx.array_equal(loaded.model(PROMPT), fresh.model(PROMPT)).item()


def test_the_key_names_the_isa_that_reads_the_layout(monkeypatch: pytest.MonkeyPatch):
    from mlxd import kernels
    from mlxd.models.packed_cache import layout_identity

    here = layout_identity(False)
    assert here["isa"] == kernels.isa() and here != layout_identity(True)
    assert layout_identity(True) != layout_identity(True, precise=False)
    # The head's layout is named where it differs: a key kept before it existed still reads.
    assert layout_identity(True, head_dot=True) == layout_identity(True)
    assert layout_identity(True, head_dot=False) != layout_identity(True)
    assert layout_identity(False, head_dot=True) not in (
        layout_identity(False),
        layout_identity(True),
    )
    other = "avx2" if here["isa"] == "generic" else "generic"  # forced to generic too
    monkeypatch.setattr(kernels, "isa", lambda: other)
    assert layout_identity(False) != here


@pytest.mark.parametrize(
    "place",
    [
        ["float32", [1001], 64],  # past the file's end
        ["float32", [65536, 65536, 65536, 65536], 64],  # a size that wraps around
        ["float32", [-1], 64],
        ["float32", [500], 128],  # no byte count of its own before it
        ["float32", [1000], 60],  # not where an array can start
        ["complex64", [1000], 64],
    ],
)
def test_a_header_that_does_not_fit_its_file_is_refused(tmp_path: Path, place: list[Any]):
    import struct

    path = tmp_path / "a.packed"
    room = {"room": " " * 64}  # for a longer header in the same place
    write_arrays(path, {"a": mx.arange(1000, dtype=mx.float32)}, {"format": FORMAT, **room})
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")

    def placed(where: list[Any]) -> None:
        header = json.loads(data[8 : 8 + length])
        del header["room"]
        header["arrays"]["a"] = where
        text = json.dumps(header).encode().ljust(length)  # the data stays where it was
        assert len(text) == length
        path.write_bytes(struct.pack("<Q", length) + text + data[8 + length :])

    placed(["float32", [1000], 64])  # as written: read
    assert mx.array_equal(read_arrays(path)[0]["a"], mx.arange(1000, dtype=mx.float32)).item()
    placed(place)
    with pytest.raises((ValueError, KeyError)):
        read_arrays(path)


@pytest.mark.parametrize(
    "layers", ['["model.layers.0.mlp.up_proj"]', '{"model.embed_tokens": [Infinity, true, true]}']
)
def test_a_header_of_the_wrong_shape_repacks(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layers: str
):
    _load(model_dir, tmp_path)
    (kept,) = _files(tmp_path)
    arrays, header = read_arrays(kept)
    placeholder = '"' + "L" * 78 + '"'  # room for `layers` in the same header length
    header["layers"] = placeholder[1:-1]
    _rewrite(kept, arrays, header)
    del arrays
    data = kept.read_bytes()
    kept.write_bytes(data.replace(placeholder.encode(), layers.encode().ljust(80)))
    packings = Packings(monkeypatch)
    _load(model_dir, tmp_path)
    assert packings.count > 0
