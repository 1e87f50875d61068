"""An embedding model: mlx-embeddings weights behind a request-coalescing core."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from mlxd.config import ModelConfig, ServerConfig
from mlxd.errors import InvalidRequest
from mlxd.models.embedding import LoadedEmbedding, load_embedding
from mlxd.types import EmbeddingInput, Embeddings
from mlxd.worker.embedding_core import EmbeddingCore, EmbeddingJob
from mlxd.worker.jobs import deliver
from mlxd.worker.loop import ModelLoop
from mlxd.worker.service import ServiceEngine


class EmbeddingEngine(ServiceEngine):
    kind = "embedding"

    def __init__(self, name: str, config: ModelConfig, loaded: LoadedEmbedding):
        super().__init__(name, config)
        self.loaded = loaded
        # context_length, when set, lowers (or raises) the model's own input limit.
        self.max_length = config.context_length or loaded.max_length
        self.dimensions = loaded.dimensions
        self.core = EmbeddingCore(
            name, loaded.forward, config.batch, arriving=lambda: self._submitting
        )
        self.loop = ModelLoop(name, self.core, deliver, config.batch.max_queue)
        self.memory_bytes = loaded.nbytes
        self._submitting = 0  # being tokenized

    @classmethod
    async def load(
        cls, name: str, config: ModelConfig, path: Path, server: Callable[[], ServerConfig]
    ) -> EmbeddingEngine:
        """Load weights from a resolved model directory (`server` is unused: encoders keep
        no SSD tier and read no media)."""
        loaded = await asyncio.to_thread(load_embedding, path, dtype=config.dtype, model_name=name)
        return cls(name, config, loaded)

    async def embed(
        self, inputs: EmbeddingInput, *, truncate: bool, dimensions: int | None = None
    ) -> Embeddings:
        """Vectors of `inputs` (texts, or token ids without special tokens), L2-normalised
        again after cutting them to `dimensions` when the model normalises."""
        if dimensions is not None and dimensions > self.dimensions:
            raise InvalidRequest(
                f"dimensions is {dimensions}; model '{self.name}' has {self.dimensions}",
                param="dimensions",
            )
        with self.serving():
            vectors, tokens = await self._embed(inputs, truncate)
        if dimensions is not None and dimensions < vectors.shape[1]:
            vectors = vectors[:, :dimensions]
            if self.loaded.pooling.normalize:
                norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                vectors = vectors / np.maximum(norms, 1e-12)
        return Embeddings(vectors, tokens)

    async def _embed(self, inputs: EmbeddingInput, truncate: bool) -> tuple[np.ndarray, int]:
        self._submitting += 1
        try:
            token_ids = await asyncio.to_thread(self.tokenize, inputs, truncate)
            loop = asyncio.get_running_loop()
            job = EmbeddingJob(token_ids, loop, loop.create_future())
            self.loop.submit(job)
        finally:
            self._submitting -= 1
        try:
            return await job.future, sum(map(len, token_ids))
        finally:
            # The caller went away (its wait cancelled the future): its inputs are skipped.
            if job.future.cancelled() or not job.future.done():
                self.loop.abort(job)

    def tokenize(self, inputs: EmbeddingInput, truncate: bool) -> list[list[int]]:
        """Model inputs with special tokens, each at most `max_length` tokens; blocking."""
        loaded = self.loaded
        if inputs and isinstance(inputs[0], str):
            encodings = loaded.tokenizer.encode_batch(inputs, add_special_tokens=False)
            contents: list[list[int]] = [e.ids for e in encodings]
        else:
            contents = cast(list[list[int]], inputs)  # not strings: token id lists
            vocab = loaded.tokenizer.get_vocab_size()
            for position, ids in enumerate(contents):
                if any(not 0 <= t < vocab for t in ids):
                    raise InvalidRequest(
                        f"input[{position}]: token ids must be in [0, {vocab})", param="input"
                    )
        specials = len(loaded.prefix) + len(loaded.suffix)
        room = self.max_length - specials
        if not truncate:
            for position, ids in enumerate(contents):
                if len(ids) > room:
                    raise InvalidRequest(
                        f"input[{position}] is {len(ids) + specials} tokens; "
                        f"model '{self.name}' accepts at most {self.max_length} "
                        "(truncate: false)",
                        param="input",
                    )
        return [[*loaded.prefix, *ids[:room], *loaded.suffix] for ids in contents]

    def stats(self) -> dict[str, Any]:
        s = self.core.stats
        return {
            "kind": self.kind,
            "dtype": self.loaded.dtype,
            "weights_bytes": self.loaded.nbytes,
            "memory_bytes": self.memory_bytes,
            "dimensions": self.dimensions,
            "max_length": self.max_length,
            "pooling": "+".join(self.loaded.pooling.modes)
            + ("+normalize" if self.loaded.pooling.normalize else ""),
            "max_batch_size": self.config.batch.max_batch_size,
            "in_flight": self._open,  # requests taken and not yet answered
            "requests": s.requests,
            "inputs": s.inputs,
            "forward_passes": s.forward_passes,
            "forward_seconds": round(s.forward_seconds, 3),
            "multi_request_passes": s.multi_request_passes,
            "max_batch_seen": s.max_batch_seen,
            "prompt_tokens": s.tokens,
            "padded_tokens": s.padded_tokens,
            "cancelled": s.cancelled,
            "failed": s.failed,
        }
