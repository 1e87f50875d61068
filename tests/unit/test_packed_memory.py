"""Packing a lazily loaded model holds about one copy of its weights, not two (issue 26: an
8B Q4_K_M peaked at twice its weights while loading)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest


def test_packing_releases_each_stored_layer_as_it_goes(tmp_path: Path):
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
    from mlxd.models.packed import PackedEmbedding, PackedLinear, pack_model

    tied, untied = _Model(separate_head=False), _Model(separate_head=True)
    for model in (tied, untied):
        nn.quantize(model, group_size=32, bits=4)
        pack_model(model)
    assert isinstance(tied.embed_tokens, PackedEmbedding)
    assert isinstance(untied.lm_head, PackedLinear)
    assert type(untied.embed_tokens) is nn.QuantizedEmbedding  # lookups only: no packed copy


class _Model(nn.Module):
    def __init__(self, separate_head: bool, vocab: int = 256, dims: int = 64) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dims)
        if separate_head:
            self.lm_head = nn.Linear(dims, vocab, bias=False)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (8, 32)])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_tied_embedding_looks_up_from_its_packed_table(bits, group_size, mixed):
    from mlxd.models.loader import flat_parameters
    from mlxd.models.packed import PackedEmbedding, pack_model

    model = _Model(separate_head=False, vocab=96, dims=128)
    nn.quantize(model, group_size=group_size, bits=bits)
    stored = model.embed_tokens
    stored.set_dtype(mx.float32)  # as the loader has it: scales and biases in float32
    ids = mx.array([[0, 17, 95, 16], [15, 31, 32, 64]])
    expected, x = stored(ids), mx.random.normal((3, 128))
    expected_logits = stored.as_linear(x)
    pack_model(model, (lambda rows: "float32") if mixed else None)
    embedding = model.embed_tokens
    assert isinstance(embedding, PackedEmbedding)
    got = embedding(ids)
    assert got.dtype == mx.float32 and got.shape == (2, 4, 128)
    assert mx.array_equal(got, expected).item()
    assert mx.allclose(embedding.as_linear(x), expected_logits, atol=1e-4).item()
    names = [name for name, _ in flat_parameters(embedding)]
    assert all(name.startswith("output.") for name in names)  # no stored table beside it
