"""Ollama's model store as a source: `ollama://llama3.2:3b` is the GGUF Ollama already pulled.

Ollama keeps models under `$OLLAMA_MODELS` (default `~/.ollama/models`) as a registry would:
`manifests/<host>/<namespace>/<model>/<tag>` is an OCI-style manifest (JSON) whose layers name
content-addressed blobs, `blobs/sha256-<hex>`. The layer of media type
`application/vnd.ollama.image.model` is the GGUF file itself; `…image.params` is a JSON object
of sampling parameters (Ollama's Modelfile PARAMETERs); `…image.template` the chat template in
Go's template syntax. Names follow `ollama pull`: `model[:tag]`, `namespace/model[:tag]` or
`host/namespace/model[:tag]`, the tag defaulting to `latest`, the namespace to `library` and the
host to `registry.ollama.ai`.

No MLX here: the daemon resolves and watches these paths too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEME = "ollama://"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"

# Ollama PARAMETER → the YAML's `defaults` key it means (the others have no mlxd equivalent or
# belong to llama.cpp's runner: num_gpu, num_thread, mirostat …).
SAMPLING_PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": "max_tokens",
    "stop": "stop",
}


class OllamaStoreError(Exception):
    """A name that does not parse, or a store, model, tag or blob that is not there."""


@dataclass(frozen=True)
class OllamaModel:
    """One pulled model: where its manifest and GGUF blob are, and its params and template."""

    name: str  # as written after ollama://
    manifest: Path
    gguf: Path
    params: dict[str, Any]
    template: str | None


def store_root() -> Path:
    """Where Ollama keeps its models: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def manifest_path(name: str, root: Path | None = None) -> Path:
    """The manifest file `name` (`llama3.2:3b`, `ns/model`, `host/ns/model:tag`) lives at."""
    tagged = ":" in name.rpartition("/")[2]  # a host may carry a port: only the last part's
    path, _, tag = name.rpartition(":") if tagged else (name, "", "")
    parts = path.split("/")
    if len(parts) > 3 or not all(parts) or (tagged and not tag):
        raise OllamaStoreError(f"{SCHEME}{name}: expected [host/][namespace/]model[:tag]")
    host, namespace, model = [DEFAULT_HOST, DEFAULT_NAMESPACE][: 3 - len(parts)] + parts
    return (root or store_root()) / "manifests" / host / namespace / model / (tag or DEFAULT_TAG)


def resolve(name: str, root: Path | None = None) -> OllamaModel:
    """The pulled model `name` in the store at `root` (default: store_root()).

    Raises OllamaStoreError saying which part is missing: the store, the model, its tag (with
    the tags it has), its GGUF layer or a blob.
    """
    root = root or store_root()
    manifest = manifest_path(name, root)
    if not manifest.is_file():
        raise OllamaStoreError(_missing(name, root, manifest))
    try:
        layers = json.loads(manifest.read_text())["layers"]
        by_type = {layer["mediaType"]: layer["digest"] for layer in layers}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OllamaStoreError(f"{SCHEME}{name}: unreadable manifest {manifest}: {exc}") from exc
    if MODEL_LAYER not in by_type:
        raise OllamaStoreError(
            f"{SCHEME}{name}: manifest {manifest} has no model layer ({MODEL_LAYER})"
        )
    blobs = {kind: _blob(root, digest, name) for kind, digest in by_type.items()}
    params = _read_json(blobs[PARAMS_LAYER], name) if PARAMS_LAYER in blobs else {}
    template = blobs[TEMPLATE_LAYER].read_text() if TEMPLATE_LAYER in blobs else None
    return OllamaModel(name, manifest, blobs[MODEL_LAYER], params, template)


def sampling_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """Ollama PARAMETERs as the YAML `defaults` keys they mean (num_predict -1: unset)."""
    defaults = {SAMPLING_PARAMS[k]: v for k, v in params.items() if k in SAMPLING_PARAMS}
    if not isinstance(defaults.get("max_tokens", 1), int) or defaults.get("max_tokens", 1) <= 0:
        defaults.pop("max_tokens")
    if isinstance(defaults.get("stop"), str):  # one PARAMETER stop line
        defaults["stop"] = [defaults["stop"]]
    return defaults


def _blob(root: Path, digest: str, name: str) -> Path:
    path = root / "blobs" / digest.replace(":", "-")
    if not path.is_file():
        raise OllamaStoreError(
            f"{SCHEME}{name}: blob {path} named by its manifest is missing (re-run `ollama pull "
            f"{name}`)"
        )
    return path


def _read_json(path: Path, name: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OllamaStoreError(f"{SCHEME}{name}: unreadable params blob {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _missing(name: str, root: Path, manifest: Path) -> str:
    """Which part of the store `name` lacks, and what is there instead."""
    if not (root / "manifests").is_dir():
        return (
            f"{SCHEME}{name}: no Ollama model store at {root} (set OLLAMA_MODELS to the "
            "folder that holds manifests/ and blobs/)"
        )
    model_dir = manifest.parent
    if not model_dir.is_dir():
        return f"{SCHEME}{name}: model not in the Ollama store at {root} (`ollama pull {name}`)"
    tags = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    return (
        f"{SCHEME}{name}: tag '{manifest.name}' not in the Ollama store at {root} "
        f"(it has: {', '.join(tags) or 'none'})"
    )
