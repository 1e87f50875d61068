"""Pipeline parallel for mlx-lm's llama family, which has `shard` but no `pipeline`.

The split is mlx-lm's own (`mlx_lm.models.pipeline.PipelineMixin.pipeline`, which qwen2,
deepseek and others use): rank size-1 runs the first layers, rank 0 the last ones. The forward
pass is the one those models use too: each rank receives the hidden states from rank r+1, runs
its layers and sends them on to rank r-1, then an all_gather hands rank 0's final hidden states
to every rank, so every rank computes the same logits and samples the same token. Each rank's KV
cache holds its own layers only; BatchGenerator's batched caches (left-padded prefill, batched
decode) work unchanged because every rank makes the same calls with the same shapes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.pipeline import PipelineMixin

# mlx-lm model types whose Model is llama.Model in structure (model.embed_tokens, model.layers
# of TransformerBlock, model.norm, optional lm_head) and that have no pipeline of their own.
PIPELINED_MODEL_TYPES = ("llama",)


class PipelinedLlama(nn.Module):
    """One rank's stage of a llama `Model`: a drop-in for it in BatchGenerator."""

    def __init__(self, model: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.args = model.args
        self.model_type = model.model_type
        self.model = model.model
        if not model.args.tie_word_embeddings:
            self.lm_head = model.lm_head
        self._group = group
        # mlx-lm's split: sets start_idx/end_idx and drops (None-s) the other ranks' layers, so
        # their lazily loaded weights are never read.
        PipelineMixin.pipeline(self.model, group)

    @property
    def layers(self) -> list[nn.Module]:
        """This rank's layers: what the KV cache is made for."""
        return self.model.layers[self.model.start_idx : self.model.end_idx]

    def make_cache(self) -> list[Any]:
        window = self.model.sliding_window
        return [
            RotatingKVCache(max_size=window) if layer.use_sliding else KVCache()
            for layer in self.layers
        ]

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        out = self.model.norm(self.hidden(inputs, cache, input_embeddings))
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        return self.lm_head(out)

    @property
    def prefill_backbone(self) -> Any:
        """What mlxd's prefill runs instead of the whole model (executor/prefill.py): the
        stages without the head. `self.model` alone would run every layer, this rank's or not."""
        return self.hidden

    def hidden(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        """Rank 0's last hidden states, on every rank."""
        group = self._group
        rank, size = group.rank(), group.size()
        layers = self.layers
        h = input_embeddings if input_embeddings is not None else self.model.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(layers)
        masks = self._masks(h, layers, cache)

        if rank < size - 1:  # every rank but the first stage takes its input from rank r+1
            h = mx.distributed.recv_like(h, rank + 1, group=group)
        for layer, layer_cache, mask in zip(layers, cache, masks, strict=True):
            h = layer(h, mask, cache=layer_cache)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=group)
            # BatchGenerator evaluates only the caches during prefill: tie the send to them so
            # it happens then, as the receiving rank expects.
            if cache[-1] is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        # Rank 0 ran the last layers; all_gather stacks every rank's h on axis 0, and rank 0's
        # comes first. Every rank then has the same logits.
        return mx.distributed.all_gather(h, group=group)[: h.shape[0]]

    def _masks(self, h: mx.array, layers: list[nn.Module], cache: list[Any]) -> list[Any]:
        """One mask per local layer, built from the first local cache of each attention kind
        (as llama.py does with its first full / sliding layer)."""
        built: dict[bool, Any] = {}
        for layer, layer_cache in zip(layers, cache, strict=True):
            if layer.use_sliding not in built:
                window = self.model.sliding_window if layer.use_sliding else None
                built[layer.use_sliding] = create_attention_mask(h, layer_cache, window_size=window)
        return [built[layer.use_sliding] for layer in layers]


def pipeline_model(model: nn.Module, group: mx.distributed.Group) -> nn.Module:
    """`model` split for pipeline parallel over `group`: mlx-lm's own `pipeline` where the
    architecture has one, else `PipelinedLlama`. Call before evaluating the weights."""
    inner = getattr(model, "model", None)
    if isinstance(inner, PipelineMixin):
        inner.pipeline(group)
        return model
    if getattr(model, "model_type", None) in PIPELINED_MODEL_TYPES:
        return PipelinedLlama(model, group)
    raise ValueError(
        f"no pipeline parallel for model type {getattr(model, 'model_type', '?')!r}; "
        "use strategy: tensor"
    )
