"""The GGUF conversion's shards written past the page cache (models/direct_write.py): the file is
safetensors as MLX and the `safetensors` package read it, whatever the dtypes, the sizes against
the aligned buffer, and where the filesystem has no O_DIRECT."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from mlxd.models import direct_write


@pytest.fixture
def direct(tmp_path: Path) -> None:
    """Skip where the filesystem of the tests' temporary files refuses O_DIRECT (tmpfs before
    Linux 6.6): there every write takes the ordinary path, which the other tests cover."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        pytest.skip(f"not applicable here: {tmp_path} refuses O_DIRECT")


def _arrays() -> dict[str, mx.array]:
    arrays = {
        "weight": mx.random.randint(0, 2**31, (37, 129)).astype(mx.uint32),
        "scales": mx.random.normal((37, 5)),
        "half": mx.random.normal((3, 7)).astype(mx.float16),
        "brain": mx.random.normal((11,)).astype(mx.bfloat16),
        "mask": mx.array([True, False, True]),
        "scalar": mx.array(2.5),
        "empty": mx.zeros((0, 4)),
        "strided": mx.arange(64, dtype=mx.int32).reshape(8, 8)[:, ::3],  # not contiguous
    }
    mx.eval(list(arrays.values()))
    return arrays


def _check(path: Path, arrays: dict[str, mx.array]) -> None:
    loaded, metadata = mx.load(str(path), return_metadata=True)
    assert isinstance(loaded, dict) and metadata == {"format": "mlx"}
    assert loaded.keys() == arrays.keys()
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        assert mx.array_equal(loaded[name], array).item(), name
    # The reference reader too (numpy has no bfloat16).
    with safe_open(str(path), framework="np") as reference:
        assert set(reference.keys()) == arrays.keys()
        for name, array in arrays.items():
            if array.dtype != mx.bfloat16:
                expected = np.array(array)
                np.testing.assert_array_equal(reference.get_tensor(name), expected, name)


@pytest.mark.parametrize("chunk", [4096, 8192, 1 << 20])
def test_the_file_reads_back_whatever_the_buffer_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, direct: None
):
    # Small buffers put array ends, the header's end and the last block at every alignment.
    monkeypatch.setattr(direct_write, "_CHUNK", chunk)
    blocks: list[int] = []
    write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: blocks.append(len(data)) or write(fd, data))
    arrays = _arrays()
    path = tmp_path / "shard.safetensors"
    direct_write.save_safetensors(path, arrays, {"format": "mlx"})
    assert blocks and all(size % 4096 == 0 for size in blocks)  # the direct path, whole blocks
    _check(path, arrays)
    # Cut to its length: no padding after the last tensor.
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert path.stat().st_size == 8 + header + sum(a.nbytes for a in arrays.values())


def test_a_filesystem_without_direct_writes_gets_an_ordinary_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answered before Linux 6.6
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    arrays = _arrays()
    direct_write.save_safetensors(tmp_path / "s.safetensors", arrays, {"format": "mlx"})
    _check(tmp_path / "s.safetensors", arrays)


def test_blocks_the_device_refuses_are_written_the_ordinary_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    def refused(fd: int, data: Any) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")  # a device with larger blocks

    monkeypatch.setattr(direct_write, "_write_aligned", refused)
    arrays = _arrays()
    direct_write.save_safetensors(tmp_path / "s.safetensors", arrays, {"format": "mlx"})
    _check(tmp_path / "s.safetensors", arrays)


def test_a_failed_write_raises_oserror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(FileNotFoundError):
        direct_write.save_safetensors(tmp_path / "missing" / "s.safetensors", _arrays(), {})

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_write, "_write_aligned", full)
    with pytest.raises(OSError) as raised:
        direct_write.save_safetensors(tmp_path / "s.safetensors", _arrays(), {})
    assert raised.value.errno == errno.ENOSPC


def test_a_short_write_is_a_failed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: None
):
    # What the disk took of a block before it filled: the rest would not start aligned.
    monkeypatch.setattr(os, "write", lambda fd, data: len(data) // 2)
    with pytest.raises(OSError) as raised:
        direct_write.save_safetensors(tmp_path / "s.safetensors", _arrays(), {})
    assert raised.value.errno == errno.ENOSPC
