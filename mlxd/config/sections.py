"""The sections of one model's entry: batching, speculation, cache, parsers, sampling
defaults, distribution."""

from __future__ import annotations

import difflib
from typing import Literal, NamedTuple

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlxd.config.fields import ConfigPath, Section
from mlxd.config.units import ByteSize, Duration
from mlxd.parsers.registry import REASONING_PARSERS, TOOL_PARSER_NAMES, TOOL_PARSERS

# Prefill costs the same per token from ≈250-token steps up (measured on SmolLM2 on 2 cores),
# so larger groups only delay first tokens: with 32 prompts arriving together, 256-token
# groups halved the median time to first token against 1,024 (see docs/performance.md).
PREFILL_STEP_TOKENS = 256
# An embedding request waits for all its inputs anyway: larger passes cost it nothing.
EMBEDDING_PASS_TOKENS = 1024


class BatchConfig(Section):
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


class SpeculativeConfig(Section):
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
    # mode draft: the draft's weights, filled in by the Config from the model `model` names
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


class CacheConfig(Section):
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
    kv_dtype: Literal["auto", "float16", "float32"] = Field(
        "auto",
        description="Element type of the live KV cache on the CPU, where mlxd's attention "
        "kernel runs the model (llama, mistral, qwen2, qwen3 architectures): float16 is half "
        "the bytes, as llama.cpp's default f16 cache; float32 keeps the compute dtype; auto "
        "is float16 where the CPU converts halves in hardware (F16C, NEON; not the kernels' "
        "generic variant, where attention over halves is several times slower). Other "
        "backends and architectures keep the compute dtype.",
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


class ParsersConfig(Section):
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


class SamplingDefaults(Section):
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
    stop: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Stop strings of a request that sets none (Ollama's PARAMETER stop); a "
        "request's own stop strings replace them, as in Ollama.",
    )


class DistributedConfig(Section):
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
    hostfile: ConfigPath | None = Field(
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


class AudioConfig(Section):
    """Limits and defaults of speech models (kind stt or tts)."""

    max_bytes: ByteSize = Field(
        25 * 1024 * 1024,
        description="stt: largest uploaded audio file (OpenAI's limit is 25 MB); larger is a 413.",
    )
    max_seconds: float = Field(
        1800.0,
        gt=0,
        description="stt: longest audio accepted, in seconds (decoding stops there); longer "
        "is a 400. Audio past 30 s is transcribed in consecutive 30 s windows.",
    )
    max_input_chars: int = Field(
        4096, ge=1, description="tts: longest `input` text (OpenAI's limit is 4096 characters)."
    )
    voice: str | None = Field(
        None,
        description="tts: the voice used when a request names one the model lacks "
        "(OpenAI's alloy, echo …); null: such a request is a 400.",
    )
