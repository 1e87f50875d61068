"""Prometheus metrics and the recent-window figures `/v1/status` shows.

Request counters and latency histograms are observed once per request when its record closes
(see `observe.py`); gauges that mirror engine state are read at scrape time by a collector, so
they are never stale. Each app owns its registry: several apps (tests) never share series.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mlxd import accel

if TYPE_CHECKING:
    from mlxd.api.middleware.observe import RequestRecord
    from mlxd.daemon import Daemon

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TOKENS_WINDOW_S = 60
TTFT_WINDOW_S = 300
TTFT_SAMPLES = 256


class Recent:
    """One model's last minute of generated tokens and last few minutes of TTFTs."""

    def __init__(self) -> None:
        self._tokens: deque[list[int]] = deque()  # [second, tokens generated in it]
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=TTFT_SAMPLES)

    def add_tokens(self, count: int, now: float) -> None:
        second = int(now)
        if self._tokens and self._tokens[-1][0] == second:
            self._tokens[-1][1] += count
        else:
            self._tokens.append([second, count])
        self._prune(now)

    def add_ttft(self, ttft_s: float, now: float) -> None:
        self._ttfts.append((now, ttft_s))

    def _prune(self, now: float) -> None:
        while self._tokens and self._tokens[0][0] <= now - TOKENS_WINDOW_S:
            self._tokens.popleft()

    def rate(self, now: float, window_s: float) -> float:
        """Tokens per second over the last `window_s` whole seconds before `now`."""
        self._prune(now)
        end = int(now)  # the current second is still filling up
        count = sum(n for second, n in self._tokens if end - window_s <= second < end)
        return round(count / window_s, 2)

    def summary(self, now: float) -> dict[str, float | None]:
        self._prune(now)
        ttfts = sorted(t for at, t in self._ttfts if at > now - TTFT_WINDOW_S)
        return {
            "tokens_per_s": round(sum(n for _, n in self._tokens) / TOKENS_WINDOW_S, 2),
            "ttft_p50_s": _percentile(ttfts, 0.50),
            "ttft_p95_s": _percentile(ttfts, 0.95),
        }


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 4)


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self.recent: dict[str, Recent] = {}
        # Called with each closed request's access-line fields (the dashboard's request log).
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        r = self.registry
        self.requests = Counter(
            "mlxd_requests", "HTTP requests answered.", ["model", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "mlxd_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            "mlxd_completion_tokens", "Completion tokens generated.", ["model"], registry=r
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "mlxd_time_per_output_token_seconds",
            "Mean time between generated tokens of one request, after the first.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "mlxd_request_duration_seconds",
            "From request arrival to the end of the response (streams included).",
            ["model", "endpoint"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        r.register(EngineCollector(daemon))

    def tokens(self, model: str, count: int) -> None:
        self.recent.setdefault(model, Recent()).add_tokens(count, time.time())

    def observe(self, record: RequestRecord, duration_s: float) -> None:
        model = record.model or ""
        self.requests.labels(model, record.endpoint, str(record.status)).inc()
        self.duration.labels(model, record.endpoint).observe(duration_s)
        if not record.model:
            return
        self.prompt_tokens.labels(model).inc(record.prompt_tokens)
        self.completion_tokens.labels(model).inc(record.completion_tokens)
        if record.ttft_s is not None:
            self.ttft.labels(model).observe(record.ttft_s)
            self.recent.setdefault(model, Recent()).add_ttft(record.ttft_s, time.time())
        if record.decode_s is not None and record.completion_tokens > 1:
            self.tpot.labels(model).observe(record.decode_s / (record.completion_tokens - 1))

    def summary(self, model: str) -> dict[str, float | None]:
        return self.recent.get(model, Recent()).summary(time.time())

    def rate(self, model: str, window_s: float, now: float) -> float:
        """`model`'s generated tokens per second over the last `window_s` seconds."""
        return self.recent.get(model, Recent()).rate(now, window_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Engine and daemon state, read when Prometheus scrapes."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def describe(self) -> list[Metric]:
        return []  # unchecked: the series depend on which models run

    def collect(self) -> Iterator[Metric]:
        daemon = self.daemon
        uptime = GaugeMetricFamily("mlxd_uptime_seconds", "Seconds since the daemon started.")
        uptime.add_metric([], time.time() - daemon.started_at)
        generation = GaugeMetricFamily(
            "mlxd_config_generation", "How many times the config was applied."
        )
        generation.add_metric([], daemon.config_status.generation)
        info = GaugeMetricFamily("mlxd_backend_info", "Compute backend in use.", labels=["backend"])
        info.add_metric([accel.describe()], 1)
        reloads = CounterMetricFamily(
            "mlxd_config_reloads", "Config reloads by outcome.", labels=["outcome"]
        )
        for outcome, count in daemon.reloads.items():
            reloads.add_metric([outcome], count)
        loads = CounterMetricFamily(
            "mlxd_model_loads", "Model loads by model and outcome.", labels=["model", "outcome"]
        )
        for (model, outcome), count in daemon.reconciler.loads.items():
            loads.add_metric([model, outcome], count)
        yield from (uptime, generation, info, reloads, loads)
        yield from _model_metrics(daemon.reconciler.status())


def _model_metrics(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "mlxd_model_state", "1 for the state each model is in.", labels=["model", "state"]
    )
    queue = GaugeMetricFamily("mlxd_queue_depth", "Requests waiting for a slot.", labels=["model"])
    running = GaugeMetricFamily(
        "mlxd_running_sequences", "Sequences being generated.", labels=["model"]
    )
    occupancy = GaugeMetricFamily(
        "mlxd_batch_occupancy", "Running sequences / max_batch_size.", labels=["model"]
    )
    memory = GaugeMetricFamily(
        "mlxd_model_memory_bytes",
        "What the memory budget counts for the loaded engine: its estimate (weights plus KV "
        "budget) or, once larger, its worker's resident memory.",
        labels=["model"],
    )
    rss = GaugeMetricFamily(
        "mlxd_worker_rss_bytes", "Resident memory of the model's worker process.", labels=["model"]
    )
    hits = CounterMetricFamily(
        "mlxd_cache_hits", "Prompt-cache hits by tier.", labels=["model", "tier"]
    )
    misses = CounterMetricFamily("mlxd_cache_misses", "Prompt-cache misses.", labels=["model"])
    evictions = CounterMetricFamily(
        "mlxd_cache_evictions", "Prompt-cache evictions by tier.", labels=["model", "tier"]
    )
    cache_bytes = GaugeMetricFamily(
        "mlxd_cache_bytes", "Prompt-cache bytes held by tier.", labels=["model", "tier"]
    )
    drafts = CounterMetricFamily(
        "mlxd_speculative_draft_tokens",
        "Draft tokens verified by speculative decoding.",
        labels=["model"],
    )
    accepted = CounterMetricFamily(
        "mlxd_speculative_accepted_tokens",
        "Draft tokens the model agreed with (each saves a decode step).",
        labels=["model"],
    )
    acceptance = GaugeMetricFamily(
        "mlxd_speculative_acceptance_rate",
        "Accepted / verified draft tokens since the model loaded.",
        labels=["model"],
    )
    for name, row in models.items():
        state.add_metric([name, row["state"]], 1)
        if "running" not in row:
            continue  # not loaded: no engine to read
        queue.add_metric([name], row.get("waiting", 0))
        running.add_metric([name], row["running"])
        if row.get("max_batch_size"):
            occupancy.add_metric([name], row["running"] / row["max_batch_size"])
        memory.add_metric([name], row.get("memory_bytes", 0))
        if row.get("rss_bytes") is not None:
            rss.add_metric([name], row["rss_bytes"])
        if speculative := row.get("speculative"):
            drafts.add_metric([name], speculative["draft_tokens"])
            accepted.add_metric([name], speculative["accepted_tokens"])
            if speculative["acceptance_rate"] is not None:
                acceptance.add_metric([name], speculative["acceptance_rate"])
        cache = row.get("cache")
        if not cache:
            continue
        for tier, count in cache.get("hits", {}).items():
            hits.add_metric([name, tier], count)
        misses.add_metric([name], cache.get("misses", 0))
        for tier, count in cache.get("evictions", {}).items():
            evictions.add_metric([name, tier], count)
        for tier, count in cache.get("bytes", {}).items():
            cache_bytes.add_metric([name, tier], count)
    yield from (state, queue, running, occupancy, memory, rss, drafts, accepted, acceptance)
    yield from (hits, misses, evictions, cache_bytes)
