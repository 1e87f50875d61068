"""The YAML contract as pydantic models; their field descriptions become the config reference."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from mlxd.config.units import ByteSize, Duration
from mlxd.parsers.registry import REASONING_PARSERS, TOOL_PARSER_NAMES, TOOL_PARSERS
from mlxd.types import RENDER_ARGUMENTS

_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]*")
_SOURCE_SCHEMES = ("pkg://", "hf://")


def _check_model_id(value: str) -> str:
    if not _MODEL_ID.fullmatch(value):
        raise PydanticCustomError(
            "model_id",
            f"invalid model id {value!r}: use letters, digits and . _ : / @ - "
            "(starting with a letter or digit)",
        )
    return value


ModelId = Annotated[str, AfterValidator(_check_model_id)]
"""A name clients may put in a request's `model` field."""


def _drop_empty_keys(keys: list[str]) -> list[str]:
    # `api_keys: ["${MLXD_API_KEY:-}"]` with the variable unset must mean "open", not "key ''".
    return [key for key in keys if key.strip()]


ApiKeys = Annotated[list[str], AfterValidator(_drop_empty_keys)]


class _Section(BaseModel):
    """Every section rejects unknown keys (typos must not pass silently) and is immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RateLimitConfig(_Section):
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


class MetalConfig(_Section):
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


class ServerConfig(_Section):
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
    cache_dir: Path = Field(
        Path("~/.cache/mlxd"),
        validate_default=True,
        description="Directory for converted weights and the SSD KV-cache tier (`~` expanded).",
    )
    responses_ttl: Duration = Field(
        30 * 86400.0,
        gt=0,
        description="How long stored Responses API answers (`store: true`, kept under "
        "cache_dir/responses/ for retrieval and `previous_response_id`) are kept.",
    )
    memory_budget: ByteSize | None = Field(
        None,
        description="Memory all loaded models may use together; idle models beyond it are "
        "unloaded least recently used first. Unset means no limit.",
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
    max_image_bytes: ByteSize = Field(
        20 * 1024**2, description="Largest accepted encoded image, inline or fetched."
    )
    media_fetch_timeout: Duration = Field(
        10.0, description="Longest the daemon spends fetching one remote image."
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

    @field_validator("cache_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("media_dirs")
    @classmethod
    def _expand_media_dirs(cls, value: list[Path]) -> list[Path]:
        return [path.expanduser() for path in value]


# Prefill costs the same per token from ≈250-token steps up (measured on SmolLM2 on 2 cores),
# so larger groups only delay first tokens: with 32 prompts arriving together, 256-token
# groups halved the median time to first token against 1,024 (see docs/performance.md).
PREFILL_STEP_TOKENS = 256
# An embedding request waits for all its inputs anyway: larger passes cost it nothing.
EMBEDDING_PASS_TOKENS = 1024


class BatchConfig(_Section):
    """Continuous-batching limits for one model."""

    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most sequences decoded together (embedding models: inputs per forward pass).",
    )
    prefill_batch_size: int = Field(
        32, ge=1, description="Most waiting prompts prefilled together in one forward pass."
    )
    prefill_step_size: int = Field(
        PREFILL_STEP_TOKENS,
        ge=1,
        description="Prompt tokens processed per prefill step, across the prompts prefilled "
        "together; a longer prompt is prefilled alone in chunks of this size. Bounds how long "
        "a prefill step stalls the running decoders and how long the first prompts in line "
        f"wait for their first token. Embedding models: padded tokens per forward pass "
        f"(default {EMBEDDING_PASS_TOKENS}).",
    )
    max_queue: int = Field(
        128, ge=1, description="Requests that may wait for a slot; beyond it callers get 429."
    )


class DraftWeights(NamedTuple):
    """What a target's worker needs to load its draft model."""

    name: str
    source: str
    dtype: str


class SpeculativeConfig(_Section):
    """Speculative decoding inside the continuous batch: each step verifies a few drafted
    tokens per sequence in one forward pass and keeps the ones the model itself would emit."""

    mode: Literal["ngram", "draft"] = Field(
        "ngram",
        description="ngram: prompt lookup; the drafts are the tokens that followed the latest "
        "earlier occurrence of the sequence's last 3 (then 2, 1) tokens in its prompt and "
        "output. Pays off when the output copies the input (editing, code changes, quoting). "
        "draft: a smaller model (`model`) drafts greedily; its weights load into this model's "
        "worker too.",
    )
    model: str | None = Field(
        None,
        description="mode draft: the name of another llm model in this file whose weights "
        "draft (its source and dtype; it must share this model's vocabulary). This model's "
        "worker loads its own copy: give the draft's entry `load: lazy` if it only drafts.",
    )
    num_tokens: int = Field(4, ge=1, le=16, description="Most draft tokens verified per step.")
    disable_by_batch_size: int = Field(
        4,
        ge=1,
        description="Speculate only while at most this many sequences decode: verifying "
        "drafts is nearly free while a step is memory-bound (small batches) and costs compute "
        "once it is not.",
    )
    # mode draft: the draft's weights, filled in by the Registry from the model `model` names
    # (so a change of the draft's source or dtype restarts this model).
    _draft: DraftWeights | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _model_for_draft_only(self) -> SpeculativeConfig:
        if (self.mode == "draft") != (self.model is not None):
            raise PydanticCustomError(
                "speculative_model", "mode draft needs `model`, and only mode draft takes it"
            )
        return self

    @property
    def draft(self) -> DraftWeights | None:
        """The draft model's weights (mode draft, in a config loaded as a whole file)."""
        return self._draft


class CacheConfig(_Section):
    """Tiered KV (prompt) cache for one model."""

    ram: ByteSize = Field(
        1024**3, description="RAM tier size for reusable prompt prefixes; 0 disables the cache."
    )
    ssd: ByteSize = Field(0, description="SSD tier size under server.cache_dir; 0 disables it.")
    block_size: int = Field(16, ge=1, description="Tokens per cache block (the unit of reuse).")
    kv_bits: Literal[4, 8] | None = Field(
        None, description="Quantize cached keys/values to 4 or 8 bits; null keeps full precision."
    )
    kv_group_size: Literal[32, 64, 128] = Field(
        64, description="Group size for KV quantization (must divide the model's head size)."
    )
    ssd_ttl: Duration | None = Field(
        7 * 86400.0,
        description="Drop SSD blocks unused for this long; null keeps them until the ssd "
        "budget evicts them.",
    )


def _known_name(kind: str, names: list[str], value: str) -> str:
    """`value` if it is one of `names`; otherwise an error that suggests the closest one."""
    if value in names:
        return value
    close = difflib.get_close_matches(value, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PydanticCustomError(
        "parser_name", f"unknown {kind} parser {value!r}{hint}; valid: {', '.join(names)}"
    )


class ParsersConfig(_Section):
    """Which output parsers turn raw model text into tool calls and reasoning."""

    tool_calls: str | None = Field(
        "auto",
        description="Tool-call parser: auto (the format the chat template teaches), "
        f"{', '.join(TOOL_PARSERS)}. null turns tool calling off: a request offering tools "
        "gets 400.",
    )
    reasoning: str | None = Field(
        None,
        description=f"Reasoning parser: {', '.join(REASONING_PARSERS)}; null leaves thinking "
        "text in the content.",
    )

    @field_validator("tool_calls")
    @classmethod
    def _tool_parser_exists(cls, value: str | None) -> str | None:
        return None if value is None else _known_name("tool-call", TOOL_PARSER_NAMES, value)

    @field_validator("reasoning")
    @classmethod
    def _reasoning_parser_exists(cls, value: str | None) -> str | None:
        return None if value is None else _known_name("reasoning", list(REASONING_PARSERS), value)


class SamplingDefaults(_Section):
    """Sampling used when a request leaves a parameter out (YAML key `defaults`)."""

    max_tokens: int = Field(512, ge=1, description="Tokens to generate when a request sets none.")
    temperature: float = Field(0.7, ge=0, le=2, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="Sample among the k likeliest tokens; 0 disables it.")
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens below this fraction of the top probability."
    )
    repetition_penalty: float | None = Field(
        None, gt=0, description="Multiplicative penalty on repeated tokens; null disables it."
    )
    presence_penalty: float = Field(
        0.0, ge=-2, le=2, description="Additive penalty on tokens already present (OpenAI)."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2, le=2, description="Additive penalty scaled by token count so far (OpenAI)."
    )


def _anchored(path: Path, info: ValidationInfo) -> Path:
    """A path from the config file, relative ones taken from the file's directory."""
    path = path.expanduser()
    base_dir = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    # normpath, not resolve(): tidy `./` and `../` without chasing symlinks.
    return Path(os.path.normpath(path))


class DistributedConfig(_Section):
    """One model split over a group of ranks started by `mlx.launch` (see docs/distributed.md)."""

    backend: Literal["ring", "jaccl", "mpi"] = Field(
        "ring",
        description="mx.distributed backend: ring (TCP, e.g. over Thunderbolt), jaccl (RDMA "
        "over Thunderbolt 5; needs a hostfile with rdma devices) or mpi.",
    )
    hosts: list[str] | None = Field(
        None,
        min_length=1,
        description="One entry per rank, rank 0 first (the machine running mlxd); hosts are "
        "reached over ssh as mlx.launch does; 127.0.0.1 repeated runs ranks on this machine. "
        "Give hosts or hostfile, not both.",
    )
    hostfile: Path | None = Field(
        None,
        description="An mlx.launch hostfile (JSON, e.g. made by mlx.distributed_config); "
        "relative to the config file.",
    )
    strategy: Literal["tensor", "pipeline"] = Field(
        "tensor",
        description="tensor: every rank holds a slice of every layer (the rank count must "
        "divide the attention and KV heads); pipeline: every rank holds a run of whole layers "
        "(at most one rank per layer).",
    )

    @field_validator("hostfile")
    @classmethod
    def _anchor_hostfile(cls, hostfile: Path | None, info: ValidationInfo) -> Path | None:
        return None if hostfile is None else _anchored(hostfile, info)

    @field_validator("hosts")
    @classmethod
    def _no_blank_hosts(cls, hosts: list[str] | None) -> list[str] | None:
        if hosts is not None and any(not host.strip() for host in hosts):
            raise PydanticCustomError("blank_host", "host names must not be empty")
        return hosts

    @model_validator(mode="after")
    def _one_host_list(self) -> DistributedConfig:
        if (self.hosts is None) == (self.hostfile is None):
            raise PydanticCustomError(
                "hosts_or_hostfile", "give either hosts (a list) or hostfile (a path)"
            )
        if self.backend == "jaccl" and self.hostfile is None:
            raise PydanticCustomError(
                "jaccl_hostfile",
                "backend jaccl needs a hostfile naming each host's rdma devices "
                "(make one with mlx.distributed_config)",
            )
        return self


class ModelConfig(_Section):
    """One served model: where its weights come from and how it is run."""

    kind: Literal["llm", "vlm", "embedding"] = Field("llm", description="What the model does.")
    source: str = Field(
        min_length=1,
        description="Weights: pkg://MODULE/PATH (inside an installed package), hf://ORG/REPO, "
        "or a local file/directory. Relative paths are relative to the config file.",
    )
    aliases: list[ModelId] = Field(
        default_factory=list,
        description="Other ids clients may use for this model; must be unique across models.",
    )
    load: Literal["eager", "lazy"] = Field(
        "eager", description="eager: load at startup; lazy: load on the first request."
    )
    idle_ttl: Duration | None = Field(
        None, description="Unload after this long unused; null keeps the model loaded."
    )
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batching limits.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="KV cache tiers.")
    parsers: ParsersConfig = Field(
        default_factory=ParsersConfig, description="Tool-call and reasoning parsers."
    )
    defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults, description="Sampling defaults for requests."
    )
    api_keys: ApiKeys = Field(
        default_factory=list,
        description="If non-empty, only these keys (and server.api_keys) may use this model.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "keep"] = Field(
        "auto",
        description="Compute dtype. auto picks per backend: on the CPU a quantized model runs "
        "packed on mlxd's kernels (stored bits), anything else as float32; on Metal/CUDA as "
        "stored. keep leaves the weights as stored (e.g. quantized, on MLX's own kernels).",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Reject prompts longer than this; null means the context length."
    )
    context_length: int | None = Field(
        None, ge=1, description="Override the context length from the model's own config."
    )
    rate_limit: RateLimitConfig | None = Field(
        None,
        description="Each client's requests to this model (on top of server.rate_limit); "
        "null: unlimited.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Variables for the chat template, e.g. {enable_thinking: false} for "
        "Qwen3-style templates; a request's own chat_template_kwargs override them key by key.",
    )
    truncate: bool = Field(
        True,
        description="Embedding models: cut inputs longer than the model's maximum length "
        "(true) or reject them with 400 (false).",
    )
    adapter: Path | None = Field(
        None,
        description="A LoRA adapter applied on top of `source` (mlx-lm's format, as "
        "mlx_lm.lora writes it: a directory with adapter_config.json and "
        "adapters.safetensors); relative to the config file. llm models only. Models of "
        "the same source and engine settings with different adapters share one engine "
        "holding the base weights once.",
    )
    distributed: DistributedConfig | None = Field(
        None,
        description="Split this llm over several ranks (machines, or processes on loopback); "
        "null runs it in one process.",
    )
    stream_interval: int | None = Field(
        None,
        ge=1,
        description="Tokens per streamed chunk for this model; null: server.stream_interval.",
    )
    speculative: SpeculativeConfig | None = Field(
        None,
        description="llm models: speculative decoding (output unchanged, greedy token for "
        "token; sampled in distribution); null decodes one token per step.",
    )
    max_inputs: int = Field(
        2048,
        ge=1,
        description="Embedding models: most inputs in one /v1/embeddings request (OpenAI's "
        "limit is 2048); more is a 400.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_render_arguments(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if reserved := sorted(RENDER_ARGUMENTS & kwargs.keys()):
            raise PydanticCustomError(
                "render_argument", f"may not set {', '.join(reserved)}: mlxd sets it"
            )
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _embedding_pass_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("kind") != "embedding":
            return data
        batch = data.get("batch") or {}
        if isinstance(batch, dict) and "prefill_step_size" not in batch:
            data = {**data, "batch": {**batch, "prefill_step_size": EMBEDDING_PASS_TOKENS}}
        return data

    @model_validator(mode="after")
    def _distributed_llm_only(self) -> ModelConfig:
        if self.distributed is not None and self.kind != "llm":
            raise PydanticCustomError(
                "distributed_kind", f"distributed runs llm models only (this model is {self.kind})"
            )
        return self

    @model_validator(mode="after")
    def _speculative_llm_only(self) -> ModelConfig:
        if self.speculative is not None and (self.kind != "llm" or self.distributed):
            raise PydanticCustomError(
                "speculative_kind",
                "speculative decoding runs on single-process llm models only",
            )
        return self

    @model_validator(mode="after")
    def _adapter_on_local_llm_only(self) -> ModelConfig:
        if self.adapter is not None and (self.kind != "llm" or self.distributed is not None):
            raise PydanticCustomError(
                "adapter_kind", "adapter applies to llm models run in one process only"
            )
        return self

    @field_validator("adapter")
    @classmethod
    def _anchor_adapter(cls, adapter: Path | None, info: ValidationInfo) -> Path | None:
        return None if adapter is None else _anchored(adapter, info)

    @field_validator("aliases")
    @classmethod
    def _dedupe(cls, aliases: list[str]) -> list[str]:
        return list(dict.fromkeys(aliases))

    @field_validator("source")
    @classmethod
    def _resolve_path(cls, source: str, info: ValidationInfo) -> str:
        """Anchor relative paths to the config file's directory, so any cwd works."""
        if source.startswith(_SOURCE_SCHEMES):
            return source
        if "://" in source:
            raise PydanticCustomError(
                "source_scheme",
                f"unsupported source {source!r}: use pkg://, hf:// or a local path",
            )
        path = Path(source).expanduser()
        base_dir = (info.context or {}).get("base_dir")
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        # normpath, not resolve(): tidy `./` and `../` without chasing symlinks.
        return os.path.normpath(path)


class Registry(_Section):
    """A whole config file: the server section and every model, keyed by name."""

    server: ServerConfig = Field(default_factory=ServerConfig, description="Server settings.")
    models: dict[ModelId, ModelConfig] = Field(
        default_factory=dict, description="Served models by name; the name is the default id."
    )
    _routes: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("server", "models", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        # `models:` with every entry commented out is YAML null: treat it as an empty section.
        return {} if value is None else value

    @model_validator(mode="after")
    def _build_routes(self) -> Registry:
        routes = {name: name for name in self.models}
        errors: list[InitErrorDetails] = []
        for name, model in self.models.items():
            for index, alias in enumerate(model.aliases):
                owner = routes.setdefault(alias, name)
                if owner == name:
                    continue
                clash = (
                    f"is the name of model {owner!r}"
                    if owner == alias
                    else f"is already an alias of model {owner!r}"
                )
                errors.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "alias_collision", f"alias {alias!r} of model {name!r} {clash}"
                        ),
                        loc=("models", name, "aliases", index),
                        input=alias,
                    )
                )
        if errors:
            # A ValidationError (not a ValueError) keeps each clash's own location for the loader.
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        self._routes = routes
        return self

    @model_validator(mode="after")
    def _resolve_drafts(self) -> Registry:
        errors: list[InitErrorDetails] = []
        for name, model in self.models.items():
            speculative = model.speculative
            draft_name = speculative.model if speculative else None
            if speculative is None or draft_name is None:
                continue
            draft = self.models.get(draft_name)
            if draft is None or draft.kind != "llm" or draft_name == name:
                errors.append(
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "draft_model",
                            f"speculative.model {draft_name!r} of model {name!r} must "
                            "name another llm model in this file",
                        ),
                        loc=("models", name, "speculative", "model"),
                        input=draft_name,
                    )
                )
                continue
            # On copies: the configs may be the caller's (and shared with another Registry).
            speculative = speculative.model_copy()
            speculative._draft = DraftWeights(draft_name, draft.source, draft.dtype)
            self.models[name] = model.model_copy(update={"speculative": speculative})
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def routes(self) -> dict[str, str]:
        """Every id clients may use (model names and aliases) mapped to its model's name."""
        return dict(self._routes)

    def resolve(self, model_id: str) -> str | None:
        """The name of the model that `model_id` (a name or an alias) refers to, if any."""
        return self._routes.get(model_id)

    def ids(self) -> list[str]:
        """All ids clients may use: model names, then aliases, each in file order."""
        return list(self._routes)
