"""`mlxd check` exit codes and messages, run as a user would."""

import subprocess
import sys
from pathlib import Path


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(path)], capture_output=True, text=True
    )


def refusal(tmp_path: Path, text: str) -> str:
    """What `mlxd check` says of a bad.yaml holding `text`, which it must refuse."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    result = check(bad)
    assert result.returncode == 1
    return result.stderr


def test_check_accepts_the_shipped_config():
    result = check(Path(__file__).parents[2] / "config" / "models.yaml")
    assert result.returncode == 0, result.stderr
    assert "ok (3 models: smol, minilm, whisper)" in result.stdout


def test_check_reports_line_and_suggestion(tmp_path: Path):
    stderr = refusal(
        tmp_path, "models:\n  smol:\n    source: ./x\n    batch:\n      max_batch_sise: 4\n"
    )
    assert "bad.yaml:5: models.smol.batch.max_batch_sise" in stderr
    assert "did you mean 'max_batch_size'" in stderr


def test_check_missing_file(tmp_path: Path):
    result = check(tmp_path / "nope.yaml")
    assert result.returncode == 1
    assert "not found" in result.stderr


def test_check_rejects_unknown_parser_names(tmp_path: Path):
    stderr = refusal(
        tmp_path, "models:\n  smol:\n    source: ./x\n    parsers: {tool_calls: nonsense}\n"
    )
    assert "bad.yaml:4: models.smol.parsers.tool_calls: unknown tool-call parser" in stderr


def test_check_reads_adapter_directories_relative_to_the_file(tmp_path: Path):
    good = tmp_path / "adapters" / "good"
    good.mkdir(parents=True)
    (good / "adapter_config.json").write_text('{"num_layers": 2}')
    (good / "adapters.safetensors").write_bytes(b"")
    half = tmp_path / "adapters" / "half"
    half.mkdir()
    (half / "adapters.safetensors").write_bytes(b"")
    config = tmp_path / "models.yaml"
    config.write_text(
        "models:\n"
        "  good: {source: ./x, adapter: adapters/good}\n"
        "  gone: {source: ./x, adapter: ./adapters/gone}\n"
        "  half: {source: ./x, adapter: adapters/half}\n"
    )
    result = check(config)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"{config}:3: models.gone.adapter: adapter directory {tmp_path}/adapters/gone "
        "does not exist",
        f"{config}:4: models.half.adapter: adapter directory {half} has no adapter_config.json",
    ]
    (half / "adapter_config.json").write_text("[1]")
    assert f"{half}/adapter_config.json is not a JSON object" in check(config).stderr
    (half / "adapter_config.json").write_text("{}")
    assert "models.half" not in check(config).stderr


def test_check_rejects_an_adapter_on_an_embedding_model(tmp_path: Path):
    stderr = refusal(tmp_path, "models:\n  e: {kind: embedding, source: ./x, adapter: ./a}\n")
    assert "models.e: adapter applies to llm models run in one process only" in stderr


def test_check_rejects_a_draft_model_the_file_does_not_serve(tmp_path: Path):
    stderr = refusal(
        tmp_path,
        "models:\n  smol: {source: ./x}\n  smol-spec:\n    source: ./x\n"
        "    speculative: {mode: draft, model: smoll}\n",
    )
    assert (
        "bad.yaml:5: models.smol-spec.speculative.model: speculative.model 'smoll' of model "
        "'smol-spec' must name another llm model in this file"
    ) in stderr
