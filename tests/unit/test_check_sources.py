"""`mlxd check` reads each GGUF's header (never its tensor data) and refuses what the importer
cannot take, with the YAML line of the model's source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.gguf_files import write_gguf


def check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(config)], capture_output=True, text=True
    )


def test_check_refuses_an_unsupported_gguf_with_its_line(tmp_path: Path):
    write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    write_gguf(tmp_path / "q81.gguf", matrix_type="Q8_1")
    write_gguf(tmp_path / "t5.gguf", tokenizer="t5")
    write_gguf(tmp_path / "fine.gguf", matrix_type="Q4_K")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    config = tmp_path / "models.yaml"
    config.write_text(
        "models:\n"
        "  fine: {source: fine.gguf}\n"
        "  snake:\n"
        "    kind: llm\n"
        "    source: ./mamba.gguf\n"
        "  q81: {source: q81.gguf}\n"
        "  t5: {source: t5.gguf}\n"
        "  broken: {source: broken.gguf}\n"
    )
    result = check(config)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0].startswith(
        f"{config}:5: models.snake.source: model 'snake': mamba.gguf: GGUF architecture 'mamba' "
        "is not supported (supported: "
    )
    assert lines[1] == (
        f"{config}:6: models.q81.source: model 'q81': q81.gguf: GGML tensor types not "
        "supported: Q8_1"
    )
    assert lines[2].startswith(
        f"{config}:7: models.t5.source: model 't5': t5.gguf: tokenizer model 't5' is not supported"
    )
    assert lines[3].startswith(f"{config}:8: models.broken.source: model 'broken': broken.gguf: ")
    assert len(lines) == 4  # nothing about `fine`

    config.write_text("models:\n  fine: {source: fine.gguf}\n")
    assert check(config).returncode == 0
