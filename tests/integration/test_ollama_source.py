"""A household moving from Ollama: `source: ollama://smollm2:135m` serves the GGUF that Ollama's
store already holds, with its PARAMETERs as the model's defaults. Real daemon, real SmolLM2
weights in a store laid out as Ollama lays it, the official `ollama` client."""

from __future__ import annotations

from pathlib import Path

import ollama
import pytest

from mlxd.models.source_paths import source_path
from tests.integration.daemon import SMOL_GGUF, start_daemon
from tests.ollama_store import pull

pytestmark = pytest.mark.integration

PARAMS = {"temperature": 0, "num_predict": 12, "num_ctx": 1024, "stop": ["<|im_end|>", "Paris"]}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_model_from_ollamas_store_answers_with_its_parameters(
    tmp_path: Path, mlxd_cache_dir: Path
):
    store = tmp_path / "ollama-models"
    pull(
        store,
        "smollm2",
        "135m",
        source_path(SMOL_GGUF, model_name="smol"),
        params=PARAMS,
        template="{{ .Prompt }}",
    )
    config = {
        "server": {"cache_dir": str(mlxd_cache_dir)},
        "models": {"smollm2": {"source": "ollama://smollm2:135m"}},
    }
    daemon = start_daemon(tmp_path, config, env={"OLLAMA_MODELS": str(store)})
    try:
        row = daemon.status()["models"]["smollm2"]
        assert row["state"] == "loaded", row
        assert row["context_length"] == 1024  # num_ctx
        client = ollama.Client(host=daemon.url)
        assert client.pull("smollm2").status == "success"
        # The model's PARAMETER stop ends the answer where the request sets no stop of its own.
        cut = client.chat(model="smollm2", messages=QUESTION)
        assert "France" in cut.message.content and "Paris" not in cut.message.content
        assert cut.done_reason == "stop"
        reply = client.chat(model="smollm2", messages=QUESTION, options={"stop": ["<|im_end|>"]})
        assert "Paris" in reply.message.content
        assert reply.eval_count <= 12  # num_predict, as the model's default
        shown = client.show("smollm2")
        assert "num_predict                    12" in (shown.parameters or "")
        assert "temperature                    0" in (shown.parameters or "")
        assert 'stop                           "Paris"' in (shown.parameters or "")
    finally:
        assert daemon.stop() == 0
