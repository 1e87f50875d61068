"""Packing a lazily loaded model holds about one copy of its weights, not two (issue 26: an
8B Q4_K_M peaked at twice its weights while loading)."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_packing_releases_each_stored_layer_as_it_goes(tmp_path: Path):
    import mlx.core as mx
    import mlx.nn as nn

    from mlxd import kernels
    from mlxd.models.loader import flat_parameters
    from mlxd.models.packed import PackedLinear, pack_model

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")

    def quantized_stack() -> nn.Module:
        model = nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(8)))
        nn.quantize(model, group_size=32, bits=4)
        return model

    stored = quantized_stack()
    mx.eval(stored.parameters())
    stored.save_weights(str(tmp_path / "model.safetensors"))
    layer_bytes = sum(a.nbytes for _, a in flat_parameters(stored.layers[0]))
    del stored
    mx.clear_cache()

    model = quantized_stack()
    mx.eval(model.parameters())  # the placeholders, freed by the lazy load that replaces them
    model.load_weights(str(tmp_path / "model.safetensors"))  # lazy: read while packing
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pack_model(model)
    packed_bytes = sum(a.nbytes for _, a in flat_parameters(model))

    assert all(isinstance(layer, PackedLinear) for layer in model.layers)
    # Every layer swapped at the end: the packed model plus all 8 stored layers at the peak.
    assert mx.get_peak_memory() - before <= packed_bytes + 2 * layer_bytes


def test_an_embedding_gets_a_packed_copy_only_when_it_is_the_output_head():
    import mlx.nn as nn

    from mlxd.models.packed import PackedEmbedding, PackedLinear, pack_model

    class Model(nn.Module):
        def __init__(self, separate_head: bool) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(256, 64)
            if separate_head:
                self.lm_head = nn.Linear(64, 256, bias=False)

    tied, untied = Model(separate_head=False), Model(separate_head=True)
    for model in (tied, untied):
        nn.quantize(model, group_size=32, bits=4)
        pack_model(model)
    assert isinstance(tied.embed_tokens, PackedEmbedding)
    assert isinstance(untied.lm_head, PackedLinear)
    assert type(untied.embed_tokens) is nn.QuantizedEmbedding  # lookups only: no packed copy
