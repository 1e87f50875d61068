"""Streaming load generator for an OpenAI-compatible `/v1/chat/completions` endpoint.

For each concurrency level C it runs C workers that together send a fixed number of streaming
requests, each with a prompt no other request in the sweep uses (so a prompt cache cannot turn
the benchmark into a cache benchmark), and reports aggregate completion tok/s, TTFT percentiles
and failures.

    mlxd bench --url http://127.0.0.1:8000 --model smol --concurrency 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httpx

_ADJECTIVES = [
    "brave", "sleepy", "curious", "tiny", "ancient", "clumsy",
    "golden", "lonely", "cheerful", "mysterious", "stubborn", "gentle",
]  # fmt: skip
_CHARACTERS = [
    "dragon", "robot", "lighthouse keeper", "fox", "astronaut", "baker",
    "octopus", "librarian", "knight", "cat", "gardener", "violinist",
]  # fmt: skip
_PLACES = [
    "in a desert", "on the moon", "under the sea", "in a busy city", "in a snowy forest",
    "on a pirate ship", "in a small village", "inside a volcano", "on a train",
    "in a haunted castle", "at a night market", "on a floating island",
]  # fmt: skip

WARMUP_MAX_TOKENS = 4
# Request sampling settings by label. "t0.7/p0.9" is how chat clients sample; top_k 0 and min_p
# 0 keep a peer's own defaults (llama.cpp: top_k 40, min_p 0.05) from narrowing its choice.
GREEDY: Mapping[str, float] = {"temperature": 0.0}
SAMPLING: dict[str, Mapping[str, float]] = {
    "greedy": GREEDY,
    "t0.7/p0.9": {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
}


def story_prompts() -> Iterator[str]:
    """Endless distinct prompts: 1728 combinations, then the same ones with a round number."""
    for round_no in itertools.count(1):
        suffix = "" if round_no == 1 else f" (version {round_no})"
        for adjective, character, place in itertools.product(_ADJECTIVES, _CHARACTERS, _PLACES):
            yield f"Write a short story about a {adjective} {character} {place}{suffix}."


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    ok: int
    failed: int
    completion_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_request(self) -> float:
        """Completion tokens of an answered request, on average: a server that stops early
        (an end-of-sequence token, a stop string) shows here, not as speed."""
        return self.completion_tokens / self.ok if self.ok else 0.0


def percentile(values: list[float], pct: float) -> float | None:
    """Linear-interpolated percentile (pct in 0..100); None when there is nothing to rank."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * pct / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class ErrorLog:
    """Counts failures by message and prints each distinct message once, so a burst of
    identical connection resets neither floods the terminal nor goes unreported."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.counts: Counter[str] = Counter()

    def add(self, message: str) -> None:
        if message not in self.counts:
            print(f"[{self.label}] request failed: {message}", file=sys.stderr, flush=True)
        self.counts[message] += 1


def describe_error(exc: BaseException) -> str:
    """Name an exception by the first message in its chain: httpx wraps a connection reset
    (what an overflowing listen backlog produces) as a ReadError with an empty message."""
    cause: BaseException | None = exc
    while cause is not None and not str(cause):
        cause = cause.__cause__ or cause.__context__
    detail = f"{cause!s} ({type(cause).__name__})" if cause is not None else "no detail"
    return f"{type(exc).__name__}: {detail}"


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    sampling: Mapping[str, float] = GREEDY,
) -> RequestResult:
    """One streaming chat completion; never raises (a failure is returned as a value)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft: float | None = None
    content_chunks = 0
    usage_tokens: int | None = None
    done = False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                body_text = (await response.aread()).decode(errors="replace")
                detail = " ".join(body_text.split())[:200]
                return RequestResult(ok=False, error=f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, error=f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        content_chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        return RequestResult(ok=False, error=describe_error(exc))
    if not done:
        # A stream cut short without an exception is a failure too, not a short answer.
        return RequestResult(ok=False, error="stream ended before [DONE]")
    tokens = usage_tokens if usage_tokens is not None else content_chunks
    return RequestResult(ok=True, ttft_s=ttft, completion_tokens=tokens)


async def run_level(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    concurrency: int,
    max_tokens: int,
    requests: int,
    prompts: Iterator[str],
    sampling: Mapping[str, float] = GREEDY,
) -> LevelResult:
    errors = ErrorLog(f"C={concurrency}")
    # Warm-up outside the timed window: the first request after idle can pay for lazy loading
    # or compilation, which is not what a throughput figure should measure.
    warmup = await stream_chat(client, url, model, next(prompts), WARMUP_MAX_TOKENS)
    if not warmup.ok:
        print(f"[C={concurrency}] warm-up failed: {warmup.error}", file=sys.stderr, flush=True)

    batch = [next(prompts) for _ in range(requests)]
    pending = iter(batch)
    results: list[RequestResult] = []

    async def worker() -> None:
        # Workers share one iterator: the event loop is single-threaded, so next() never races.
        for prompt in pending:
            result = await stream_chat(client, url, model, prompt, max_tokens, sampling)
            if result.error is not None:
                errors.add(result.error)
            results.append(result)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return LevelResult(
        concurrency=concurrency,
        requests=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        completion_tokens=sum(r.completion_tokens for r in ok),
        wall_s=wall,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        errors=errors.counts,
    )


def default_requests(concurrency: int) -> int:
    return max(2 * concurrency, 4)


async def run_sweep(
    url: str,
    model: str,
    levels: list[int],
    max_tokens: int,
    requests_per_level: int | None = None,
    api_key: str | None = None,
    sampling: Mapping[str, float] = GREEDY,
) -> list[LevelResult]:
    """Run each concurrency level in turn against one server; prompts never repeat in a sweep."""
    url = url.rstrip("/")
    prompts = story_prompts()
    # A slow server holds a stream open for minutes at high concurrency; only connecting is
    # bounded tightly. trust_env=False keeps HTTP(S)_PROXY from routing loopback traffic away.
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    results = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, trust_env=False, headers=headers
    ) as client:
        for concurrency in levels:
            requests = requests_per_level or default_requests(concurrency)
            results.append(
                await run_level(
                    client, url, model, concurrency, max_tokens, requests, prompts, sampling
                )
            )
    return results


def format_seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def print_results(results: list[LevelResult]) -> None:
    header = f"{'conc':>4} {'reqs':>5} {'ok':>4} {'fail':>4} {'tok/s':>8} {'tok/req':>8} "
    header += f"{'ttft p50':>9} {'ttft p95':>9} {'wall':>8}"
    print(header)
    for r in results:
        print(
            f"{r.concurrency:>4} {r.requests:>5} {r.ok:>4} {r.failed:>4} {r.tokens_per_s:>8.1f} "
            f"{r.tokens_per_request:>8.1f} {format_seconds(r.ttft_p50_s):>9} "
            f"{format_seconds(r.ttft_p95_s):>9} {r.wall_s:>7.1f}s"
        )
    for r in results:
        for message, count in r.errors.items():
            print(f"C={r.concurrency}: {count}× {message}")


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",") if part.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels
