"""The `server` section: process-wide settings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from mlxd import host_memory
from mlxd.config.fields import ApiKeys, Section
from mlxd.config.stores import BatchStoreConfig, ResponseStoreConfig
from mlxd.config.units import ByteSize, Duration

# An unset server.memory_budget: this share of the memory the process may use (physical
# memory, or its cgroup's limit: mlxd/host_memory.py), the rest for the OS, the daemon and
# whatever else the machine runs.
DEFAULT_BUDGET_SHARE = 0.75


class RateLimitConfig(Section):
    """Per client (API key, or address when the daemon is open), over a sliding minute."""

    requests_per_minute: int | None = Field(
        None, ge=1, description="Requests admitted per minute; null: no request limit."
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="Prompt + completion tokens per minute, charged when a request finishes; "
        "null: no token limit.",
    )


class MetalConfig(Section):
    """MLX's memory limits in each worker (Apple silicon; see mlx.core.set_wired_limit)."""

    wired_limit: ByteSize | None = Field(
        None,
        description="Memory MLX keeps wired (resident, never paged out) for the model; Metal "
        "only (ignored, with a log line, on other backends). Null: MLX's default (none).",
    )
    cache_limit: ByteSize | None = Field(
        None,
        description="Freed buffers MLX keeps for reuse instead of returning them to the "
        "system; 0 disables the cache. Applies on every backend. Null: MLX's default.",
    )


class ServerConfig(Section):
    """Process-wide settings: where to listen, who may call, where to keep files."""

    host: str = Field("127.0.0.1", description="Address to listen on; 0.0.0.0 exposes the LAN.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on.")
    ollama_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Also listen on this port (e.g. 11434, Ollama's) for clients that assume "
        "Ollama's address; the same API is served on both ports. Null: only `port`.",
    )
    api_keys: ApiKeys = Field(
        default_factory=list,
        description="Keys accepted for every model (Bearer or x-api-key). Empty means open; "
        "entries that interpolate to an empty string are dropped.",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names (the `Host` header, port aside) the daemon answers besides "
        "localhost, IP addresses and `host`, e.g. `mlxd.home.arpa`; `*` answers any. Applies "
        "only while no API key is set: it stops DNS-rebinding pages from reading an open daemon.",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description="Browser origins (`scheme://host[:port]`) that may call the API from their "
        "pages (CORS, preflight included), e.g. Open WebUI's. Other cross-origin browser "
        "requests are refused. `*` (any origin) needs API keys to be set.",
    )
    cache_dir: Path = Field(
        Path("~/.cache/mlxd"),
        validate_default=True,
        description="Directory for converted weights and the SSD KV-cache tier (`~` expanded).",
    )
    responses_ttl: Duration = Field(
        30 * 86400.0,
        gt=0,
        description="How long stored Responses API answers (`store: true`, kept under "
        "cache_dir/responses/ for retrieval and `previous_response_id`) are kept; a turn "
        "continued by a later one is kept as long as that one.",
    )
    stored_responses: ResponseStoreConfig = Field(
        default_factory=ResponseStoreConfig,
        description="Per-key quotas of stored Responses API answers.",
    )
    message_batches: BatchStoreConfig = Field(
        default_factory=BatchStoreConfig,
        description="Per-key quotas, expiry and retention of Anthropic Message Batches.",
    )
    memory_budget: ByteSize | None = Field(
        None,
        description="Memory all loaded models may use together, as estimated before a load "
        "from the file headers: weights as they will run, the KV cache of "
        "batch.max_batch_size sequences at the full context, and cache.ram. Idle models "
        "beyond it are unloaded least recently used first; a model that cannot fit is refused "
        f"with the numbers before it is read. Unset: {DEFAULT_BUDGET_SHARE:.0%} of physical "
        "memory, or of a container's or cgroup's memory limit where that is lower.",
    )
    request_timeout: Duration = Field(
        600.0,
        description="Longest an interactive request may queue and run; beyond it the "
        "sequence is cancelled and the caller gets 408 (an error event when streaming).",
    )
    drain_timeout: Duration = Field(
        30.0, description="On shutdown or model swap, how long in-flight requests may finish."
    )
    load_timeout: Duration = Field(
        120.0,
        description="How long a request waits for its model to load (lazy models, startup, "
        "reloads) before it gets 503.",
    )
    max_request_bytes: ByteSize = Field(
        10 * 1024**2, description="Largest accepted HTTP request body (images included)."
    )
    workers: Literal["process", "inline"] = Field(
        "process",
        description="Where each model runs: `process`, its own worker process (a crash costs "
        "the other models nothing; unloading returns its memory to the system), or `inline`, a "
        "thread of the daemon (for debugging and measuring the boundary). Needs a restart.",
    )
    media_dirs: list[Path] = Field(
        default_factory=list,
        description="Directories whose files vlm requests may name as images (file:// URLs or "
        "paths); files elsewhere are refused. Empty means no local files.",
    )
    allow_remote_media: bool = Field(
        False,
        description="Let vlm requests name images by http(s) URL, which the daemon then fetches "
        "(within max_image_bytes and media_fetch_timeout).",
    )
    allowed_media_domains: list[str] = Field(
        default_factory=list,
        description="With allow_remote_media: the hosts (and their subdomains) images may be "
        "fetched from, e.g. `upload.wikimedia.org`; empty means any public host. Private, "
        "loopback and link-local addresses are refused unless their host is listed here. "
        "Every redirect is checked again, and each request goes to the address its check "
        "resolved (a name that resolves differently the second time gets nothing).",
    )
    max_image_bytes: ByteSize = Field(
        20 * 1024**2, description="Largest accepted encoded image, inline or fetched."
    )
    media_fetch_timeout: Duration = Field(
        10.0,
        description="Longest the daemon spends fetching one remote image, redirects and a "
        "slow sender included.",
    )
    dashboard: bool = Field(
        True,
        description="Serve the web dashboard at `/` (its data needs a server key when keys are "
        "set); false makes `/` a 404.",
    )
    rate_limit: RateLimitConfig | None = Field(
        None,
        description="Each client's requests to all models together (429 with Retry-After "
        "beyond it); null: unlimited.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="Tokens per streamed chunk (as vllm-mlx's --stream-interval), for every "
        "API dialect; larger values send fewer, bigger chunks. A model's own stream_interval "
        "overrides it.",
    )
    stream_backlog: int = Field(
        1024,
        ge=1,
        description="Events (about one per token) a response may fall behind its model by. A "
        "client that stops reading its stream for that long is disconnected and its sequence "
        "cancelled (logged with the model and request id), so it cannot make memory grow. "
        "Bounds worker processes (workers: process), not inline models.",
    )
    metal: MetalConfig = Field(
        default_factory=MetalConfig,
        description="MLX memory limits applied in each model's worker process when it starts "
        "(not to inline models).",
    )

    @property
    def budget_bytes(self) -> int:
        """`memory_budget`, or the default share of the memory the process may use when unset."""
        if self.memory_budget is not None:
            return self.memory_budget
        return int(host_memory.memory().total * DEFAULT_BUDGET_SHARE)

    @field_validator("cache_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("media_dirs")
    @classmethod
    def _expand_media_dirs(cls, value: list[Path]) -> list[Path]:
        return [path.expanduser() for path in value]
