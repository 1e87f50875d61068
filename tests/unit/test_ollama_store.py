"""`ollama://` sources: Ollama's store resolved as Ollama lays it out, its PARAMETERs as the
model's defaults, clear errors for what is missing (at `mlxd check` time too)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mlxd import ollama_store
from mlxd.config.loader import parse_config
from mlxd.errors import ModelLoadError
from mlxd.models import sources
from mlxd.models.source_paths import source_stamp
from mlxd.models.sources import resolve_source
from mlxd.ollama_store import OllamaStoreError, resolve
from tests.gguf_files import write_gguf
from tests.ollama_store import pull
from tests.unit.test_gguf import write_tiny_gguf

LLAMA3_STOPS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "ollama" / "models"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    return root


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("llama3.2:3b", "registry.ollama.ai/library/llama3.2/3b"),
        ("llama3.2", "registry.ollama.ai/library/llama3.2/latest"),
        ("jmorgan/tiny:q4", "registry.ollama.ai/jmorgan/tiny/q4"),
        ("registry.ollama.ai/library/llama3.2:3b", "registry.ollama.ai/library/llama3.2/3b"),
        ("hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M", "hf.co/bartowski/Llama-3.2-1B-GGUF/Q4_K_M"),
    ],
)
def test_names_map_onto_manifests_as_ollama_lays_them_out(store: Path, name: str, where: str):
    assert ollama_store.manifest_path(name) == store / "manifests" / where


@pytest.mark.parametrize("name", ["", "a/b/c/d", "model:", "a//b"])
def test_malformed_names(store: Path, name: str):
    with pytest.raises(OllamaStoreError, match=r"expected \[host/\]\[namespace/\]model\[:tag\]"):
        ollama_store.manifest_path(name)


def test_resolves_the_gguf_blob_params_and_template(store: Path, gguf: Path):
    params = {"stop": LLAMA3_STOPS, "temperature": 0.6, "num_ctx": 4096}
    pull(store, "llama3.2", "3b", gguf, params=params, template="{{ .Prompt }}")
    model = resolve("llama3.2:3b")
    assert model.gguf.read_bytes() == gguf.read_bytes()
    assert model.gguf.parent == store / "blobs" and model.gguf.name.startswith("sha256-")
    assert model.params == params and model.template == "{{ .Prompt }}"
    assert ollama_store.sampling_defaults(params) == {"temperature": 0.6, "stop": LLAMA3_STOPS}
    assert ollama_store.sampling_defaults({"stop": "<|eot_id|>"}) == {"stop": ["<|eot_id|>"]}


def test_default_store_is_in_the_home_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_store.store_root() == tmp_path / ".ollama" / "models"


def test_what_is_missing_is_named(store: Path, gguf: Path):
    with pytest.raises(OllamaStoreError, match=f"no Ollama model store at {store}"):
        resolve("llama3.2:3b")
    pull(store, "llama3.2", "3b", gguf)
    pull(store, "llama3.2", "1b", gguf)
    with pytest.raises(
        OllamaStoreError, match=r"model not in the Ollama store .*ollama pull qwen3"
    ):
        resolve("qwen3")
    with pytest.raises(OllamaStoreError, match=r"tag 'latest' not in .* \(it has: 1b, 3b\)"):
        resolve("llama3.2")
    pull(store, "broken", "latest", None, params={})
    with pytest.raises(OllamaStoreError, match="has no model layer"):
        resolve("broken")
    blob = resolve("llama3.2:1b").gguf
    blob.unlink()
    with pytest.raises(OllamaStoreError, match=f"blob {blob} named by its manifest is missing"):
        resolve("llama3.2:3b")


def test_parameters_become_defaults_where_the_yaml_sets_none(store: Path, gguf: Path):
    params = {"temperature": 0.2, "top_k": 20, "repeat_penalty": 1.1, "num_predict": 64}
    pull(store, "tiny", "latest", gguf, params={**params, "num_ctx": 1024, "stop": LLAMA3_STOPS})
    config = parse_config(
        "models:\n  a: {source: 'ollama://tiny'}\n"
        "  b: {source: 'ollama://tiny', context_length: 256, defaults: {temperature: 0.9}}\n"
    )
    a, b = config.models["a"], config.models["b"]
    assert (a.defaults.temperature, a.defaults.top_k, a.defaults.max_tokens) == (0.2, 20, 64)
    assert a.defaults.repetition_penalty == 1.1 and a.context_length == 1024
    assert (b.defaults.temperature, b.defaults.top_k, b.context_length) == (0.9, 20, 256)
    # Not pulled (yet): the config stays valid; the load (and mlxd check) say what is missing.
    assert parse_config("models:\n  c: {source: 'ollama://absent'}\n").models["c"].defaults


def test_a_copy_of_a_converted_blob_reuses_its_conversion(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The blob's digest is its name; its probe is recorded all the same, so the same file
    outside the store is hashed and finds the conversion instead of converting beside its hash."""
    gguf = write_tiny_gguf(tmp_path / "importable.gguf")
    pull(store, "tiny", "latest", gguf)
    converted = resolve_source("ollama://tiny", model_name="t", cache_dir=tmp_path / "cache")
    monkeypatch.setattr(sources, "GGUF", replace(sources.GGUF, convert=lambda *_: pytest.fail()))
    assert resolve_source(str(gguf), model_name="t", cache_dir=tmp_path / "cache") == converted


def test_resolve_source_converts_the_blob_without_hashing_it(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pull(store, "tiny", "latest", write_tiny_gguf(tmp_path / "importable.gguf"))
    monkeypatch.setattr("mlxd.models.file_digest.sha256", lambda path: pytest.fail("hashed"))
    converted = resolve_source("ollama://tiny", model_name="t", cache_dir=tmp_path / "cache")
    assert (converted / "config.json").is_file()
    assert converted.name.startswith(resolve("tiny").gguf.name.removeprefix("sha256-")[:16])
    with pytest.raises(ModelLoadError, match=r"model 't': ollama://gone: model not in"):
        resolve_source("ollama://gone", model_name="t", cache_dir=tmp_path / "cache")


def test_a_new_pull_changes_the_stamp(store: Path, gguf: Path, tmp_path: Path):
    before = source_stamp("ollama://tiny")
    pull(store, "tiny", "latest", gguf)
    pulled = source_stamp("ollama://tiny")
    assert pulled != before
    pull(store, "tiny", "latest", write_gguf(tmp_path / "other.gguf", layers=2))
    assert source_stamp("ollama://tiny") != pulled


def test_check_names_a_missing_tag_with_its_line(store: Path, gguf: Path, tmp_path: Path):
    pull(store, "tiny", "latest", gguf)
    config = tmp_path / "models.yaml"
    config.write_text(
        "models:\n  ok: {source: 'ollama://tiny'}\n  nope:\n    source: ollama://tiny:7b\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"{config}:4: models.nope.source: model 'nope': ollama://tiny:7b: tag '7b' not in the "
        f"Ollama store at {store} (it has: latest)"
    )
