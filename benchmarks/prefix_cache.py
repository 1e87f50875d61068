"""Prefix reuse, mlxd against llama.cpp's server and mlx_lm.server: time to first token with a
shared system prompt, after a restart, and over a growing conversation.

python -m benchmarks.prefix_cache
python -m benchmarks.prefix_cache --only mlxd,llama.cpp --system-tokens 1500

llama-server runs one 4096-token slot on the same GGUF (its prompt cache reuses the slot's KV
for a shared prefix); it keeps nothing across a restart, so its "restart" figure is a cold one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(REPO_ROOT))

import openai  # noqa: E402

from benchmarks import held_isa  # noqa: E402
from benchmarks.compare import (  # noqa: E402
    BASELINE_MODEL_ID,
    MODEL_NAME,
    SERVERS,
    ServerFailed,
    baseline_command,
    find_llama_server,
    free_port,
    gguf_path,
    llama_command,
    machine,
    resolve_model_dir,
    running_server,
    server_env,
)

QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name a primary colour.",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What do bees make?",
    "Which planet is closest to the sun?",
    "What is frozen water called?",
    "What colour is the sky on a clear day?",  # the one asked after a restart
]
TURN = (
    "Here is more about my garden: the tomatoes grow along the south fence, the beans climb "
    "the old trellis, the herbs sit in pots by the kitchen door and the roses need pruning "
    "every spring. Part {n}: summarise what I said in one short sentence."
)


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of rules (SmolLM2's tokenizer: ~15 tokens per rule)."""
    rules = (
        f"Rule {i}: answer questions about item {i} briefly and politely." for i in range(10**6)
    )
    return "You are a careful assistant. " + " ".join(next(rules) for _ in range(tokens // 15))


def ttft(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[float, str]:
    """Seconds to the first content token of a streamed greedy reply, and the reply."""
    started, first, text = time.perf_counter(), None, ""
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first or time.perf_counter() - started
            text += delta
    return first if first is not None else float("nan"), text


def shared_prompt(client: openai.OpenAI, model: str, system: str) -> list[float]:
    return [
        ttft(
            client, model, [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )[0]
        for q in QUESTIONS[:8]
    ]


def after_restart(client: openai.OpenAI, model: str, system: str) -> float:
    return ttft(
        client,
        model,
        [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[8]}],
    )[0]


def conversation(client: openai.OpenAI, model: str, turns: int) -> list[float]:
    messages: list[dict] = [{"role": "system", "content": "You are a gardening assistant."}]
    times = []
    for n in range(1, turns + 1):
        messages.append({"role": "user", "content": TURN.format(n=n)})
        seconds, reply = ttft(client, model, messages)
        times.append(seconds)
        messages.append({"role": "assistant", "content": reply})
    return times


def mlxd_command(model_dir: Path, port: int, workdir: Path) -> list[str]:
    config = {
        # The same cache_dir across the restart: the SSD tier is what is measured there.
        "server": {"host": "127.0.0.1", "port": port, "cache_dir": str(workdir / "cache")},
        "models": {
            MODEL_NAME: {
                "source": str(model_dir),
                "cache": {"ram": "1GiB", "ssd": "2GiB", "block_size": 16},
            }
        },
    }
    config_path = workdir / "mlxd.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return [sys.executable, "-m", "mlxd", "--config", str(config_path)]


def bench(
    name: str, command: Callable[[int], list[str]], model: str, args: argparse.Namespace
) -> dict[str, list[float]]:
    env, logs = server_env(), Path(tempfile.mkdtemp(prefix=f"prefix-{name}-"))
    system = system_prompt(args.system_tokens)
    results: dict[str, list[float]] = {}

    def serve(phase: str, run: Callable[[openai.OpenAI], list[float]]) -> None:
        port = free_port()
        print(f"== {name}: {phase}", flush=True)
        with running_server(command(port), port, env, logs / f"{phase}.log", 600) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=900)
            results[phase] = run(client)
        print(f"   {', '.join(f'{s:.2f}' for s in results[phase])} s", flush=True)

    serve("shared", lambda c: shared_prompt(c, model, system))
    serve("restart", lambda c: [after_restart(c, model, system)])  # same cache dir, new process
    serve("conversation", lambda c: conversation(c, model, args.turns))
    return results


def report(name: str, r: dict[str, list[float]]) -> None:
    cold, warm = r["shared"][0], r["shared"][1:]
    conv = r["conversation"]
    print(f"\n{name}")
    median = statistics.median(warm)
    print(f"  shared prompt: request 1 {cold:.2f}s; requests 2-8 median {median:.2f}s")
    print(f"    = {median / cold:.3f}x of request 1 (max {max(warm) / cold:.3f}x)")
    print(
        f"  first request after a restart: {r['restart'][0]:.2f}s = {r['restart'][0] / cold:.3f}x"
    )
    print(f"  conversation TTFT by turn: {' '.join(f'{s:.2f}' for s in conv)}")
    print(f"    last/first turn (after turn 1): {conv[-1] / conv[1]:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument(
        "--only", type=lambda text: text.split(","), default=None, help=", ".join(SERVERS)
    )
    parser.add_argument("--llama-server", type=Path, default=None, help="llama-server binary")
    held_isa.add_argument(parser)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/mlxd").expanduser())
    args = parser.parse_args(argv)
    if args.isa:
        held_isa.hold_mlxd_to(args.isa)
    model_dir = resolve_model_dir(args.model_dir, args.cache_dir)
    workdir = Path(tempfile.mkdtemp(prefix="prefix-bench-"))
    print(machine())
    print(f"model dir: {model_dir}; ~{args.system_tokens}-token system prompt", flush=True)
    servers = {
        "mlxd": (lambda port: mlxd_command(model_dir, port, workdir), MODEL_NAME),
        "baseline": (lambda port: baseline_command(model_dir, port), BASELINE_MODEL_ID),
    }
    wanted = [s for s in SERVERS if args.only is None or s in args.only]
    if "llama.cpp" in wanted:
        found = find_llama_server(args.llama_server)
        binary = held_isa.held_llama_server(args.isa, args.llama_server, found)
        gguf = gguf_path()
        if binary is None:
            print("llama.cpp: no llama-server binary; skipped", file=sys.stderr)
            wanted.remove("llama.cpp")
        else:
            servers["llama.cpp"] = (
                lambda port: llama_command(binary, gguf, port, slots=1, slot_tokens=4096),
                MODEL_NAME,
            )
    results = {}
    for name, (command, model) in servers.items():
        if name in wanted:
            try:
                results[name] = bench(name, command, model, args)
            except ServerFailed as exc:
                print(f"{name} failed: {exc}", file=sys.stderr)
    for name, r in results.items():
        report(name, r)
    if "mlxd" in results:
        for peer in [n for n in results if n != "mlxd"]:
            ours, theirs = results["mlxd"]["shared"], results[peer]["shared"]
            cold = ours[0] / theirs[0]
            cached = statistics.median(ours[1:]) / statistics.median(theirs[1:])
            print(f"\nmlxd/{peer} TTFT: cold {cold:.2f}x, cached prefix {cached:.2f}x")
            print("  (below 1: mlxd answers sooner)")
    return 0 if len(results) == len(wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
