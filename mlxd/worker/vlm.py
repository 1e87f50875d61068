"""A vision-language model: mlx-vlm weights, decoded in the LLM engine's shared batch.

An image request's prompt is prefilled on the model thread by mlx-vlm (vision tower +
projector → input embeddings → the language model fills a KV cache), then handed to the
continuous batcher with that cache and its last token: from there on it decodes in the same
steps as every other sequence, text-only or not. Qwen2-VL-style models place image tokens on a
3-D rotary grid ("mrope"), so after an image a sequence's rotary position trails its token
count by a per-sequence delta; it travels with the sequence's row of the batched KV cache
(`offset`, which only rotary embeddings read), so mixed batches need no per-row bookkeeping.

mlx-vlm is an optional extra (`pip install 'mlxd[vlm]'`), imported only when a vlm loads.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxd.config import ModelConfig, ServerConfig
from mlxd.errors import ModelLoadError
from mlxd.media import MediaPolicy, has_images, load_images
from mlxd.models.loader import FLOAT_DTYPES, LoadedModel, _target_dtype, check_model_dir
from mlxd.types import GenerationRequest
from mlxd.worker.llm import LLMEngine
from mlxd.worker.llm_prepare import Prepared
from mlxd.worker.prompt import render_chat

INSTALL_HINT = "pip install 'mlxd[vlm]'"
# prepare_inputs outputs that get_input_embeddings takes positionally or not at all.
NOT_EMBEDDING_KWARGS = ("input_ids", "pixel_values", "attention_mask")


class RopeShiftKVCache(KVCache):
    """A KV cache whose row in a batched cache starts its rotary positions `rope_shift` away
    from its length (the mrope delta of a prompt with images)."""

    rope_shift = 0

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchKVCache:
        batch = BatchKVCache.merge(caches)
        batch.offset = batch.offset + mx.array([getattr(c, "rope_shift", 0) for c in caches])
        return batch


class LanguageDecoder:
    """The VLM's language model seen as an mlx-lm model (tokens + cache → logits), for the
    batcher's `BatchGenerator`."""

    def __init__(self, vlm: Any):
        self.language_model = vlm.language_model
        # mrope models take explicit 3-D positions; they are read off the cache offsets, which
        # carry each row's delta (see RopeShiftKVCache).
        self.mrope = hasattr(self.language_model, "get_rope_index")

    @property
    def layers(self) -> list[Any]:
        return self.language_model.layers

    def make_cache(self) -> list[KVCache]:
        return [RopeShiftKVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self.mrope:
            kwargs["position_ids"] = positions(cache[0].offset, *inputs.shape)
        return self.language_model(inputs, cache=cache, **kwargs).logits


def positions(offset: int | mx.array, batch: int, length: int) -> mx.array:
    """(3, batch, length) mrope positions of text tokens: all three axes equal the offset."""
    start = offset[:, None] if isinstance(offset, mx.array) else mx.full((batch, 1), offset)
    grid = (start + mx.arange(length)[None]).astype(mx.int32)
    return mx.broadcast_to(grid[None], (3, batch, length))


def load_vlm(path: Path, *, dtype: str, model_name: str) -> tuple[LoadedModel, Any, Any]:
    """(the language side as a LoadedModel, the full mlx-vlm model, its processor)."""
    try:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from mlx_vlm.utils import load
    except ImportError as exc:
        raise ModelLoadError(
            f"model '{model_name}' is kind: vlm, which needs mlx-vlm: {INSTALL_HINT}"
        ) from exc
    path = check_model_dir(path, dtype, model_name)
    try:
        vlm, processor = load(str(path))
        target = _target_dtype(dtype)
        quantized = any(hasattr(m, "bits") for _, m in vlm.named_modules())
        if target is not None and not quantized:
            vlm.set_dtype(FLOAT_DTYPES[target])
        mx.eval(vlm.parameters())
    except Exception as exc:  # mlx-vlm / transformers raise many kinds; report one
        raise ModelLoadError(
            f"model '{model_name}': cannot load {path}: {type(exc).__name__}: {exc}"
        ) from exc
    eos = vlm.config.eos_token_id
    tokenizer = TokenizerWrapper(
        processor.tokenizer, eos_token_ids=eos if isinstance(eos, list) else [eos]
    )
    params = cast(list[tuple[str, mx.array]], tree_flatten(vlm.parameters()))
    loaded = LoadedModel(
        # Duck-typed: the batch generator calls it and reads its layers and make_cache.
        model=cast(nn.Module, LanguageDecoder(vlm)),
        tokenizer=tokenizer,
        path=Path(path),
        dtype=str(params[0][1].dtype).removeprefix("mlx.core.") if not quantized else "quantized",
        nbytes=sum(array.nbytes for _, array in params),
        config=vlm.config.text_config.__dict__,
    )
    return loaded, vlm, processor


class VLMEngine(LLMEngine):
    kind = "vlm"

    def __init__(
        self,
        name: str,
        config: ModelConfig,
        loaded: LoadedModel,
        vlm: Any,
        processor: Any,
        server: Callable[[], ServerConfig],
    ):
        super().__init__(name, config, loaded)
        self.vlm = vlm
        self.processor = processor
        self._server = server  # read per request: media settings apply on reload

    @classmethod
    async def load(
        cls, name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
    ) -> VLMEngine:
        loaded, vlm, processor = await asyncio.to_thread(
            load_vlm, path, dtype=config.dtype, model_name=name
        )
        return await cls(name, config, loaded, vlm, processor, server).started()

    def encode(self, request: GenerationRequest) -> list[int]:
        inputs = self._vision_inputs(request)
        return super().encode(request) if inputs is None else _ids(inputs)

    def prepare(self, request: GenerationRequest) -> Prepared:
        """Images are read and processed once, here; their prefill runs on the model thread."""
        inputs = self._vision_inputs(request)
        if inputs is None:
            return super().prepare(request)
        ids = _ids(inputs)
        prefill = functools.partial(self._prefill_images, inputs)
        return Prepared(
            ids, self.request_processors(request), self._admission(request, ids), prefill
        )

    def _vision_inputs(self, request: GenerationRequest) -> dict[str, Any] | None:
        """Processor outputs (ids with image tokens, pixel values, grids); None without images."""
        if request.messages is None or not has_images(request.messages):
            return None
        from mlx_vlm.utils import prepare_inputs

        images = load_images(request.messages, MediaPolicy.from_server(self._server()))
        text = render_chat(
            self.tokenizer,
            request.messages,
            request.tools,
            self.name,
            images=True,
            tokenize=False,
            template_kwargs=request.chat_template_kwargs,
        )
        return dict(prepare_inputs(self.processor, images=images, prompts=[text]))

    def _prefill_images(self, inputs: dict[str, Any]) -> tuple[list[KVCache], list[int]]:
        """On the model thread: embed the prompt with its images and fill a KV cache with all
        but the last token, which the batcher feeds to start decoding."""
        ids = inputs["input_ids"]
        extra = {k: v for k, v in inputs.items() if k not in NOT_EMBEDDING_KWARGS}
        features = self.vlm.get_input_embeddings(ids, inputs["pixel_values"], **extra)
        embeds, grid = features.inputs_embeds, getattr(features, "position_ids", None)
        language_model = self.vlm.language_model
        cache = self.loaded.model.make_cache()
        count, step = ids.shape[1] - 1, self.config.batch.prefill_step_size
        for start in range(0, count, step):
            end = min(count, start + step)
            kwargs = {} if grid is None else {"position_ids": grid[..., start:end]}
            language_model(ids[:, start:end], embeds[:, start:end], cache=cache, **kwargs)
            mx.eval([c.state for c in cache])
        deltas = getattr(features, "rope_deltas", None)
        shift = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
        for layer_cache in cache:
            layer_cache.rope_shift = shift
        return cache, [int(ids[0, -1].item())]


def _ids(inputs: dict[str, Any]) -> list[int]:
    return inputs["input_ids"][0].tolist()
