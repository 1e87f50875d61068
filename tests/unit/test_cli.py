"""`mlxd check` exit codes and messages, run as a user would."""

import subprocess
import sys
from pathlib import Path


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(path)], capture_output=True, text=True
    )


def test_check_accepts_the_shipped_config():
    result = check(Path(__file__).parents[2] / "config" / "models.yaml")
    assert result.returncode == 0, result.stderr
    assert "ok (2 models: smol, minilm)" in result.stdout


def test_check_reports_line_and_suggestion(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  smol:\n    source: ./x\n    batch:\n      max_batch_sise: 4\n")
    result = check(bad)
    assert result.returncode == 1
    assert "bad.yaml:5: models.smol.batch.max_batch_sise" in result.stderr
    assert "did you mean 'max_batch_size'" in result.stderr


def test_check_missing_file(tmp_path: Path):
    result = check(tmp_path / "nope.yaml")
    assert result.returncode == 1
    assert "not found" in result.stderr


def test_check_rejects_unknown_parser_names(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  smol:\n    source: ./x\n    parsers: {tool_calls: nonsense}\n")
    result = check(bad)
    assert result.returncode == 1
    assert "bad.yaml:4: models.smol.parsers.tool_calls: unknown tool-call parser" in result.stderr


def test_check_rejects_a_draft_model_the_file_does_not_serve(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "models:\n  smol: {source: ./x}\n  smol-spec:\n    source: ./x\n"
        "    speculative: {mode: draft, model: smoll}\n"
    )
    result = check(bad)
    assert result.returncode == 1
    assert (
        "bad.yaml:5: models.smol-spec.speculative.model: speculative.model 'smoll' of model "
        "'smol-spec' must name another llm model in this file"
    ) in result.stderr
