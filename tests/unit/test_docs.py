"""Committed docs and examples stay true: the config reference is the generator's output and
every example config passes `mlxd check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from mlxd.config import ModelConfig, ServerConfig, parse_config
from mlxd.config.reference import render

ROOT = Path(__file__).parents[2]
EXAMPLE_CONFIGS = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "config" / "models.yaml"]


def test_configuration_reference_is_up_to_date():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "run: python -m mlxd.config.reference > docs/configuration.md"


def test_reference_names_every_key():
    text = render()
    for section, prefix in ((ServerConfig, "server"), (ModelConfig, "models.<name>")):
        for name in section.model_fields:
            assert f"| `{name}` |" in text or f"## `{prefix}.{name}`" in text


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_config_passes_check(path: Path):
    env = {**os.environ, "MLXD_API_KEY": "example-key", "CODER_KEY": "coder-key"}
    result = subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(path)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert ": ok (" in result.stdout


def test_claude_code_settings_point_at_models_the_example_config_serves():
    env = json.loads((ROOT / "examples" / "claude-code-settings.json").read_text())["env"]
    # Claude Code's settings.json `env` takes strings only.
    assert all(isinstance(value, str) for value in env.values())
    base = urlsplit(env["ANTHROPIC_BASE_URL"])
    assert base.scheme == "http" and base.port and base.path in ("", "/")  # the SDK adds /v1
    config = yaml.safe_load((ROOT / "examples" / "homelab.yaml").read_text())
    ids = {
        model_id
        for name, model in config["models"].items()
        if model.get("kind", "llm") != "embedding"
        for model_id in (name, *model.get("aliases", []))
    }
    model_vars = [name for name in env if name.endswith("_MODEL")]
    assert len(model_vars) >= 4 and {env[name] for name in model_vars} <= ids
    assert int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) <= config["models"]["coder"]["context_length"]


def test_claude_code_guide_explains_every_setting():
    guide = (ROOT / "examples" / "claude-code.md").read_text()
    settings = json.loads((ROOT / "examples" / "claude-code-settings.json").read_text())
    for name in settings["env"]:
        assert f"`{name}`" in guide, name


OLLAMA_NOTES = ["home-assistant-ollama.md", "open-webui-ollama.md"]


def _fenced(text: str, language: str) -> list[str]:
    import re

    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.parametrize("name", OLLAMA_NOTES)
def test_ollama_notes_point_at_a_default_model_on_the_ollama_port(name: str):
    from urllib.parse import urlparse

    import yaml

    from mlxd.config.loader import load_config

    text = (ROOT / "examples" / name).read_text()
    blocks = _fenced(text, "json")
    assert blocks, f"{name} has no ```json connection block"
    default = load_config(ROOT / "config" / "models.yaml")
    ollama_port = yaml.safe_load((ROOT / "examples" / "ollama.yaml").read_text())["server"][
        "ollama_port"
    ]
    for block in blocks:
        connection = json.loads(block)
        # Ollama clients send `name:latest`; the daemon drops the tag for a known id.
        assert default.resolve(connection["model"].removesuffix(":latest")) is not None
        assert urlparse(connection["url"]).port == ollama_port
    for link in ("ollama.yaml",):
        assert (ROOT / "examples" / link).exists()
    for block in _fenced(text, "sh"):
        assert f":{ollama_port}" in block  # Docker snippets point at the same port


def test_codex_example_points_at_the_default_config():
    codex = tomllib.loads((ROOT / "examples" / "codex" / "config.toml").read_text())
    default = parse_config((ROOT / "config" / "models.yaml").read_text(), env={})
    provider = codex["model_providers"][codex["model_provider"]]
    server = default.server
    assert provider["wire_api"] == "responses"
    assert provider["base_url"] == f"http://{server.host}:{server.port}/v1"
    llm_ids = {
        model_id
        for name, model in default.models.items()
        if model.kind == "llm"
        for model_id in (name, *model.aliases)
    }
    assert codex["model"] in llm_ids
