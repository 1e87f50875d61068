"""The kernel layers are installed into the model the loader owns, never by patching mlx-lm:
replaced modules keep their parameter names and compute what mlx-lm's own modules compute."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import base, llama, qwen2, qwen3

from mlxd import kernels
from mlxd.models.activations import RationalSwiGLU, use_rational_swiglu
from mlxd.models.kernel_layers import KernelAttention, use_kernel_attention, use_kernel_layers
from mlxd.models.layer_eval import evaluate_per_layer

SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    vocab_size=128,
)


def tiny(family: str) -> nn.Module:
    mx.random.seed(3)
    if family == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", **SHAPE))
    elif family == "qwen2":
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", **SHAPE))
    else:
        args = qwen3.ModelArgs(
            model_type="qwen3",
            head_dim=16,
            max_position_embeddings=512,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            **SHAPE,
        )
        model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kernel_layers_keep_names_and_logits(family: str) -> None:
    if not kernels.available():
        pytest.skip("mlxd's CPU kernels are not built (python -m mlxd.kernels.build)")
    model = tiny(family)
    names = sorted(name for name, _ in tree_flatten(model.parameters()))
    ids = mx.array([[5, 17, 33, 2, 90, 64, 7, 11], [1, 2, 3, 4, 5, 6, 7, 8]])
    reference = model(ids)

    assert use_rational_swiglu(model) == 2
    assert use_kernel_layers(model) > 0
    assert use_kernel_attention(model) == 2
    assert evaluate_per_layer(model) == 2
    assert all(isinstance(layer.self_attn, KernelAttention) for layer in model.layers)
    assert all(isinstance(layer.mlp, RationalSwiGLU) for layer in model.layers)
    # The same parameters under the same names: adapters and shards still find them.
    assert sorted(name for name, _ in tree_flatten(model.parameters())) == names
    assert mx.allclose(model(ids), reference, atol=2e-4, rtol=1e-4).item()


def test_no_mlx_lm_module_is_patched() -> None:
    """The attention of every other model in the process (and mlx-lm's own) is untouched."""
    use_kernel_attention(tiny("llama"))
    for module in (llama, qwen2, qwen3):
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert type(tiny("llama").layers[0].self_attn) is llama.Attention


TEXT = dict(
    SHAPE, head_dim=16, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True
)
MINISTRAL = dict(
    TEXT,
    rope_parameters={
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 512,
    },
)
OWN_ATTENTION = dict(  # gemma2's further fields
    query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
)


@pytest.mark.parametrize(
    ("config", "swapped"),
    [
        ({"model_type": "llama", **TEXT}, True),
        ({"model_type": "mistral", **TEXT}, True),  # mlx-lm loads it as llama
        ({"model_type": "qwen3", **TEXT}, True),
        # llama's or qwen's model under another name: the probe timed these apart before
        ({"model_type": "smollm3", "no_rope_layer_interval": 2, **TEXT}, True),
        ({"model_type": "qwen2_vl", "text_config": {"model_type": "qwen2", **TEXT}}, True),
        ({"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3", **TEXT}}, True),
        ({"model_type": "pixtral", "text_config": {"model_type": "llama", **TEXT}}, True),
        # mistral3 wraps llama or ministral3, as its text_config says
        ({"model_type": "mistral3", "text_config": {"model_type": "llama", **TEXT}}, True),
        (
            {"model_type": "mistral3", "text_config": {"model_type": "ministral3", **MINISTRAL}},
            False,
        ),
        ({"model_type": "gemma2", **TEXT, **OWN_ATTENTION}, False),
        ({"model_type": "no-such-type", **TEXT}, False),
    ],
)
def test_kernel_attention_is_predicted_as_the_loader_swaps_it(config: dict, swapped: bool) -> None:
    """`has_kernel_attention` (asked by the load's probe and the memory estimate before any
    weight is read) says what `use_kernel_attention` then does to the built model."""
    from mlx_lm.utils import MODEL_REMAPPING

    from mlxd.models.kernel_layers import has_kernel_attention

    assert has_kernel_attention(config) is swapped
    if config["model_type"] == "no-such-type" or not kernels.available():
        return
    module = __import__(
        f"mlx_lm.models.{MODEL_REMAPPING.get(config['model_type'], config['model_type'])}",
        fromlist=["Model"],
    )
    model = module.Model(module.ModelArgs.from_dict(config))
    assert (use_kernel_attention(model) > 0) is swapped
