"""A tiny random-weight llama for tests that need a real mlx-lm model and no weights on disk."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama


def tiny_llama(vocab_size: int = 64, seed: int = 0) -> llama.Model:
    """2 layers, hidden 32, 4 heads over 2 KV heads; the same weights for the same seed."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model
