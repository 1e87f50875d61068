"""Pure helpers of the Ollama dialect: folding streamed chunks, times, model details."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from mlxd.control.routes import ModelEntry

# The Ollama API level mlxd speaks. Clients (Open WebUI, the ollama CLI) read /api/version
# and gate features such as tools and `think` on it, so it names a current Ollama release.
OLLAMA_VERSION = "0.12.0"


async def fold(chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """Streamed message deltas folded into one: text and thinking concatenated, tool calls
    and logprobs collected, the final chunk's `done`/stats kept (`stream: false`)."""
    folded: dict[str, Any] = {"content": ""}
    async for chunk in chunks:
        for key, value in chunk.items():
            if key in ("content", "thinking"):
                folded[key] = folded.get(key, "") + value
            elif key in ("tool_calls", "logprobs"):
                folded.setdefault(key, []).extend(value)
            else:
                folded[key] = value
    return folded


def iso_time(epoch: float | None = None) -> str:
    """RFC 3339 with nanosecond-style fraction, as Ollama writes `created_at`."""
    moment = datetime.fromtimestamp(time.time() if epoch is None else epoch, UTC)
    return moment.isoformat().replace("+00:00", "Z")


def parse_arguments(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the object Ollama sends. The parsers emit JSON; a model
    that wrote something else still gets its text through, under `arguments`."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def model_details(entry: ModelEntry) -> dict[str, Any]:
    """Ollama's `details`: what mlxd knows without loading the model."""
    source = entry.config.source
    engine = entry.engine
    dtype = ""
    if engine is not None:
        dtype = str(engine.stats().get("dtype") or "")
    return {
        "parent_model": "",
        "format": "gguf" if source.endswith(".gguf") else "mlx",
        "family": entry.config.kind,
        "families": [entry.config.kind],
        "parameter_size": "",
        "quantization_level": dtype,
    }
