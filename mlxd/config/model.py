"""One entry of the `models` map."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mlxd import ollama_store
from mlxd.config.fields import ApiKeys, ConfigPath, ModelId, Section, anchored
from mlxd.config.sections import (
    EMBEDDING_PASS_TOKENS,
    AudioConfig,
    BatchConfig,
    CacheConfig,
    DistributedConfig,
    ParsersConfig,
    SamplingDefaults,
    SpeculativeConfig,
)
from mlxd.config.server import RateLimitConfig
from mlxd.config.units import Duration
from mlxd.types import RENDER_ARGUMENTS

_SOURCE_SCHEMES = ("pkg://", "hf://", ollama_store.SCHEME)
# The kinds that generate text (and keep a KV cache).
TEXT_KINDS = frozenset({"llm", "vlm"})
# What the other kinds serve, for the 400 a request meant for another kind gets.
SERVES = {
    "embedding": "/v1/embeddings",
    "stt": "/v1/audio/transcriptions and /v1/audio/translations",
    "tts": "/v1/audio/speech",
}


class ModelConfig(Section):
    """One served model: where its weights come from and how it is run."""

    kind: Literal["llm", "vlm", "embedding", "stt", "tts"] = Field(
        "llm",
        description="What the model does: llm and vlm generate text, embedding serves "
        "/v1/embeddings, stt transcribes speech (/v1/audio/transcriptions), tts speaks "
        "(/v1/audio/speech).",
    )
    source: str = Field(
        min_length=1,
        description="Weights: pkg://MODULE/PATH (inside an installed package), hf://ORG/REPO, "
        "ollama://MODEL[:TAG] (a model Ollama pulled; its PARAMETERs fill `defaults` and "
        "`context_length` where this file sets none), or a local file/directory (a .gguf, or "
        "MLX/Hugging Face layout). Relative paths are relative to the config file.",
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
        "packed on mlxd's kernels (stored bits), as float32 on BLAS, or both (e.g. packed "
        "decode, float32 prefill), whichever its load measured faster on this CPU and fits "
        "the memory budget (`cpu_path` in /v1/status); anything else as float32; on "
        "Metal/CUDA as stored. keep leaves the weights as stored (e.g. quantized, on MLX's own "
        "kernels).",
    )
    cpu_activations: Literal["auto", "precise", "int8"] = Field(
        "auto",
        description="CPU, dtype auto: how the kernels' integer dot products round the "
        "activations, per block of 32. precise: two int8 terms (within 1/64,516 of the "
        "block's largest value: the tokens mlx-lm's float matmul gives). int8: one term, "
        "as llama.cpp does (1/254; the matmuls up to 1.7x faster, answers may part from "
        "mlx-lm's after a few tokens; a K-quant GGUF's scales are then kept as float16, "
        "rounded by at most 2^-11: ≈15% fewer bytes a step). auto: int8 for models of 0.8 "
        "billion quantized weights and more (1B models), precise below (a small model's "
        "answers are fragile, and its second term costs less). The load times this layout "
        "against the float one and runs the faster, the layers and the output head each "
        "their own (`cpu_path.activations`, `dot`, `head_dot` in /v1/status); where the "
        "float layout timed faster from 32 rows on (AVX2), the int8 layout's matmuls run its "
        "buffered passes there, the weights dequantized from the int8 layout "
        "(`dot_buffer_rows`).",
    )
    warm_up: bool | None = Field(
        None,
        description="llm/vlm models: run the common request shapes once while loading (one "
        "row at prompt lengths 8, 16, … one prefill step; then 1, 2, 4, … max_batch_size "
        "rows of mixed lengths, greedy and at top-p), so a GPU compiles their kernels before "
        "the first request rather than during it (minutes on a fresh machine, once: on CUDA "
        "a worker keeps them under cache_dir/mlx-jit; a lazy model's first request may meet "
        "server.load_timeout meanwhile and get 503 with Retry-After). null: on GPU backends "
        "only (`warm_up` in /v1/status).",
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
    adapter: ConfigPath | None = Field(
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

    audio: AudioConfig = Field(
        default_factory=AudioConfig, description="Speech models: audio limits and defaults."
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
    def _ollama_parameters(cls, data: Any) -> Any:
        """An Ollama model's PARAMETERs (its params layer) where the YAML sets nothing, as if
        written here. A store or tag that is missing is the load's error (and `mlxd check`'s)."""
        source = data.get("source") if isinstance(data, dict) else None
        if not isinstance(source, str) or not source.startswith(ollama_store.SCHEME):
            return data
        try:
            params = ollama_store.resolve(source.removeprefix(ollama_store.SCHEME)).params
        except ollama_store.OllamaStoreError:
            return data
        defaults = data.get("defaults") or {}
        if isinstance(defaults, dict):
            data = {**data, "defaults": {**ollama_store.sampling_defaults(params), **defaults}}
        if "num_ctx" in params and "context_length" not in data:
            data = {**data, "context_length": params["num_ctx"]}
        return data

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
                f"unsupported source {source!r}: use pkg://, hf://, ollama:// or a local path",
            )
        return str(anchored(Path(source), info))
