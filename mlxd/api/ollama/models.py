"""The Ollama dialect's model routes: /api/tags, /api/ps, /api/show, /api/version, Ollama's
model names (`name:latest`), /api/pull for the models the YAML declares (clients such as Home
Assistant pull before use) and a clear 501 for the other model-management routes (models live
in the YAML)."""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

from quart import Blueprint

from mlxd.api.common.context import current_app
from mlxd.api.common.generation import parse_body
from mlxd.api.middleware import auth
from mlxd.api.ollama.protocol import PullRequest, ShowRequest
from mlxd.api.ollama.render import OLLAMA_VERSION, iso_time, model_details
from mlxd.control.routes import ModelEntry
from mlxd.errors import InvalidRequest, MlxdError, NotFound

blueprint = Blueprint("ollama_models", __name__)


class NotImplementedHere(MlxdError):
    status = 501
    kind = "not_implemented"


@blueprint.get("/api/tags")
async def tags() -> Any:
    """Every declared model the caller may use, named as Ollama names them (`name:latest`)."""
    daemon, caller = current_app.daemon, auth.caller()
    models = []
    for name, entry in daemon.routes.models.items():
        if caller.may_use(name):
            models.append(_model_row(name, entry))
    return {"models": models}


@blueprint.get("/api/ps")
async def ps() -> Any:
    """The loaded models, with when they unload if left idle."""
    daemon, caller = current_app.daemon, auth.caller()
    status = daemon.reconciler.status()
    models = []
    for name, entry in daemon.routes.models.items():
        row = status.get(name, {})
        if not caller.may_use(name) or row.get("state") != "loaded":
            continue
        ttl = row.get("idle_ttl_s")
        remaining = math.inf if ttl is None else max(ttl - row.get("idle_s", 0.0), 0.0)
        models.append(
            {
                **_model_row(name, entry),
                "expires_at": iso_time(time.time() + min(remaining, 100 * 365 * 86400)),
                "size_vram": 0,  # MLX on the CPU; unified memory on Apple silicon
                "context_length": row.get("context_length"),
            }
        )
    return {"models": models}


def _model_row(name: str, entry: ModelEntry) -> dict[str, Any]:
    tagged = name if ":" in name else f"{name}:latest"
    engine = entry.engine
    return {
        "name": tagged,
        "model": tagged,
        "modified_at": iso_time(current_app.daemon.config_status.loaded_at or time.time()),
        "size": getattr(engine, "memory_bytes", 0) if engine is not None else 0,
        "digest": hashlib.sha256(f"{name}\0{entry.config.source}".encode()).hexdigest(),
        "details": model_details(entry),
    }


@blueprint.post("/api/show")
async def show() -> Any:
    body = await parse_body(ShowRequest)
    requested = body.model or body.name
    if not requested:
        raise InvalidRequest("model is required", param="model")
    # Ollama names carry a tag (`smol:latest`): the route table reads them (RouteTable.name_of).
    entry = current_app.daemon.routes.entry(requested, auth.caller())
    config, engine = entry.config, entry.engine
    stats = engine.stats() if engine is not None else {}
    capabilities = {
        "llm": ["completion", "tools"],
        "vlm": ["completion", "tools", "vision"],
        "embedding": ["embedding"],
        "stt": [],  # Ollama has no audio capability to name
        "tts": [],
    }[config.kind]
    if config.parsers.reasoning:
        capabilities.append("thinking")
    details = model_details(entry)
    info: dict[str, Any] = {"general.architecture": details["family"]}
    if stats.get("context_length"):
        info[f"{details['family']}.context_length"] = stats["context_length"]
    defaults = config.defaults
    parameters = "\n".join(
        f"{key:<30} {value}"
        for key, value in (
            ("num_predict", defaults.max_tokens),
            ("temperature", defaults.temperature),
            ("top_p", defaults.top_p),
            ("top_k", defaults.top_k),
            *(("stop", json.dumps(stop)) for stop in defaults.stop),
        )
    )
    return {
        "modelfile": f"# {requested} is declared in mlxd's YAML config\nFROM {config.source}\n",
        "parameters": parameters,
        "template": getattr(engine, "chat_template", None) or "",
        "details": details,
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": iso_time(current_app.daemon.config_status.loaded_at or time.time()),
    }


@blueprint.get("/api/version")
async def version() -> Any:
    return {"version": OLLAMA_VERSION}


@blueprint.post("/api/pull")
async def pull() -> Any:
    """Ollama's pull, for a model the YAML declares: there is nothing to download (the YAML
    says where the weights are), so the answer is Ollama's success stream at once. A model the
    YAML does not declare is a 404 that says where models are declared."""
    body = await parse_body(PullRequest)
    requested = body.model or body.name
    if not requested:
        raise InvalidRequest("model is required", param="model")
    daemon = current_app.daemon
    name = daemon.routes.name_of(requested)
    if name is None or not auth.caller().may_use(name):
        where = daemon.config_path or "its YAML config file"
        raise NotFound(
            f"model '{requested}' is not declared in mlxd's config ({where}); mlxd does not "
            "download models: declare it under `models:` (e.g. source: ollama://"
            f"{requested}) and mlxd reloads the file",
            param="model",
        )
    steps = ["pulling manifest", "verifying sha256 digest", "writing manifest", "success"]
    if not body.stream:
        return {"status": steps[-1]}
    lines = "".join(json.dumps({"status": step}) + "\n" for step in steps)
    return lines, 200, {"Content-Type": "application/x-ndjson"}


@blueprint.route("/api/push", methods=["POST"])
@blueprint.route("/api/create", methods=["POST"])
@blueprint.route("/api/copy", methods=["POST"])
@blueprint.route("/api/delete", methods=["DELETE", "POST"])
async def manage() -> Any:
    raise NotImplementedHere(
        "mlxd does not push, create, copy or delete models: models are declared in "
        "mlxd's YAML config file (models: ...); edit it and mlxd reloads it"
    )
