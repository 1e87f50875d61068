"""A fake Ollama model store laid out exactly as `ollama pull` lays it out: content-addressed
blobs (`blobs/sha256-<hex>`) and an OCI-style manifest per model and tag
(`manifests/registry.ollama.ai/library/<model>/<tag>`)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any


def add_blob(root: Path, data: bytes | Path) -> dict[str, Any]:
    """Store `data` (bytes, or a file copied in) as a blob; its layer's digest and size."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    if isinstance(data, Path):
        with data.open("rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
        size = data.stat().st_size
    else:
        digest.update(data)
        size = len(data)
    target = blobs / f"sha256-{digest.hexdigest()}"
    if isinstance(data, Path):
        shutil.copyfile(data, target)
    else:
        target.write_bytes(data)
    return {"digest": f"sha256:{digest.hexdigest()}", "size": size}


def pull(
    root: Path,
    model: str,
    tag: str,
    gguf: Path | None,
    *,
    params: dict[str, Any] | None = None,
    template: str | None = None,
    namespace: str = "library",
    host: str = "registry.ollama.ai",
) -> Path:
    """Lay `gguf` out as model `host/namespace/model:tag` (as Ollama does); the manifest path."""
    layers = []
    if gguf is not None:
        layers.append({"mediaType": "application/vnd.ollama.image.model", **add_blob(root, gguf)})
    if template is not None:
        blob = add_blob(root, template.encode())
        layers.append({"mediaType": "application/vnd.ollama.image.template", **blob})
    if params is not None:
        blob = add_blob(root, json.dumps(params).encode())
        layers.append({"mediaType": "application/vnd.ollama.image.params", **blob})
    config = add_blob(root, json.dumps({"model_format": "gguf", "model_family": "llama"}).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": layers,
    }
    path = root / "manifests" / host / namespace / model / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path
