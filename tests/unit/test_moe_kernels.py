"""A mixture of experts on mlxd's CPU kernels (issue 26): the packed gather matmul
(csrc/gather_qmatmul.cpp) against MLX's `gather_qmm` and a float32 reference at real expert
shapes on every ISA variant this machine runs, mlx-lm's switch layers swapped for packed ones
with the same call signature, and tiny qwen3_moe / mixtral models giving the same greedy
tokens packed as on MLX's own quantized path."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxd import kernels
from tests.unit.test_kernel_isas import _int8_x

# (experts, N outputs, K inputs, top k): qwen3-30B-A3B's gate/up (2048 -> 768) and down
# (768 -> 2048) projections with 16 of its 128 experts (memory), Mixtral's down projection's
# K (14,336) and its gate/up K (4,096) with 4 of its 8 experts and fewer outputs.
SHAPES = [
    (16, 768, 2048, 8),
    (16, 2048, 768, 8),
    (4, 96, 14336, 2),
    (4, 160, 4096, 2),
]
WIDTHS = [(4, 64), (8, 32), (4, 128), (8, 64)]  # (bits, group size)
# Tokens: decode batches and prefill chunks; from 32 rows an expert runs the buffered path.
TOKENS = (1, 2, 5, 8, 13, 33, 64)


def _expert_case(experts: int, n: int, k: int, top_k: int, bits: int, group_size: int):
    """Quantized experts, their packed stack, the dequantized float32 stack (numpy), and x and
    router indices for the largest token count."""
    mx.random.seed(experts * n + k + bits)
    quantized = mx.quantize(
        mx.random.normal((experts, n, k)) * 0.05, group_size=group_size, bits=bits
    )
    dense = np.array(mx.dequantize(*quantized, group_size=group_size, bits=bits))
    x = mx.random.normal((max(TOKENS), k))
    # Distinct experts per token, as a router's top k.
    indices = mx.argsort(mx.random.uniform(shape=(max(TOKENS), experts)), axis=-1)[:, :top_k]
    packed = kernels.pack_experts(*quantized, group_size, bits)
    mx.eval(packed.weight, packed.scale_bias, x, indices)
    return quantized, packed, dense, x, indices.astype(mx.int32)


def _float_reference(dense: np.ndarray, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    tokens, top_k = indices.shape
    y = np.zeros((tokens, top_k, dense.shape[1]), np.float32)
    for e in np.unique(indices):
        t, j = np.nonzero(indices == e)
        y[t, j] = x[t] @ dense[e].T
    return y


def _assert_close(got: np.ndarray, expected: np.ndarray, what: object) -> None:
    # As test_kernel_isas: float32 sums in another order, held to the sums' scale.
    error = np.abs(got - expected).max()
    assert error <= 2e-5 * np.abs(expected).max() + 1e-6, (what, error)


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}-top{s[3]}")
def experts(request: pytest.FixtureRequest):
    """Per width: the packed stack, x, indices, and the float32 truth and MLX's gather_qmm
    for every token; the stack in pack_dot's layout (precise) and the truth for x as the int8
    path rounds it (computed once for every ISA)."""
    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    cases = {}
    for bits, group_size in WIDTHS:
        quantized, packed, dense, x, indices = _expert_case(*request.param, bits, group_size)
        # MLX's own: x [T, 1, 1, K] against indices [T, J] -> [T, J, 1, N].
        theirs = mx.gather_qmm(
            x[:, None, None],
            *quantized,
            rhs_indices=indices,
            transpose=True,
            group_size=group_size,
            bits=bits,
        )
        reference = _float_reference(dense, np.array(x), np.array(indices))
        dot = kernels.pack_experts(*quantized, group_size, bits, dot=True, precise=True)
        rounded, _ = _int8_x(np.array(x), precise=True)
        dot_reference = _float_reference(dense, rounded, np.array(indices))
        theirs = np.array(theirs[:, :, 0])
        cases[bits, group_size] = (packed, x, indices, reference, theirs, dot, dot_reference)
    return cases


def test_gather_qmatmul_on_each_isa_equals_gather_qmm_and_float32(kernel_isa: str, experts):
    for (bits, group_size), (packed, x, indices, reference, theirs, *_) in experts.items():
        for tokens in TOKENS:
            got = kernels.gather_qmatmul(x[:tokens], indices[:tokens], packed)
            assert got.shape == (tokens, indices.shape[1], packed.shape[0])
            what = (kernel_isa, bits, group_size, tokens)
            _assert_close(np.array(got), reference[:tokens], what)
        ours = kernels.gather_qmatmul(x, indices, packed)
        _assert_close(np.array(ours), theirs, (kernel_isa, bits, group_size, "gather_qmm"))


def test_gather_qdot_on_each_isa_equals_its_rounding_of_x(kernel_isa: str, experts):
    """pack_dot's layout (precise, as the loader packs it when the int8 dot products time
    faster): x rounded per row and block as csrc/qdot.cpp rounds it, times each expert."""
    for (bits, group_size), (_, x, indices, _, _, dot, reference) in experts.items():
        for tokens in TOKENS:
            got = kernels.gather_qmatmul(x[:tokens], indices[:tokens], dot)
            what = (kernel_isa, bits, group_size, tokens, "dot")
            _assert_close(np.array(got), reference[:tokens], what)


def test_gather_qdot_runs_an_experts_many_rows_by_the_buffered_passes(kernel_isa: str, experts):
    """`set_dot_buffer_rows`: the experts with that many rows or more give the float layout's
    very floats (their weights dequantized into the same buffer), the others the int8
    rounding of x. The threshold is the busiest expert's row count here."""
    for (bits, group_size), (packed, x, indices, _, _, dot, reference) in experts.items():
        routed = np.array(indices)
        counts = np.bincount(routed.ravel())
        many = counts[routed] >= counts.max()  # [T, J]: the pairs of the busiest experts
        assert many.any() and not many.all()
        kernels.set_dot_buffer_rows(int(counts.max()))
        try:
            got = np.array(kernels.gather_qmatmul(x, indices, dot))  # evaluated here
        finally:
            kernels.set_dot_buffer_rows(0)
        float_layout = np.array(kernels.gather_qmatmul(x, indices, packed))
        what = (kernel_isa, bits, group_size, int(counts.max()))
        assert np.array_equal(got[many], float_layout[many]), what
        _assert_close(got[~many], reference[~many], what)


def test_gather_qmatmul_takes_one_index_per_row_and_zeroes_unknown_experts():
    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    _, packed, dense, x, indices = _expert_case(4, 64, 256, 2, 4, 64)
    # SwitchGLU's sorted form and its down projection: one expert per row.
    rows = indices.reshape(-1, 1)
    per_row = mx.repeat(x, 2, axis=0)
    got = np.array(kernels.gather_qmatmul(per_row, rows, packed))
    expected = _float_reference(dense, np.array(x), np.array(indices)).reshape(-1, 1, 64)
    _assert_close(got, expected, "one per row")
    outside = mx.array([[0, 4], [-1, 3]], dtype=mx.int32)
    got = np.array(kernels.gather_qmatmul(x[:2], outside, packed))
    assert not got[0, 1].any() and not got[1, 0].any()
    reference = _float_reference(dense, np.array(x[:2]), np.array([[0], [3]]))
    _assert_close(got[[0, 1], [0, 1]], reference[:, 0], "beside unknown experts")
    with pytest.raises(ValueError, match="do not agree"):
        kernels.gather_qmatmul(x[:, :128], indices, packed)


def _switch_glu(bits: int, group_size: int):
    from mlx_lm.models.switch_layers import SwitchGLU

    mx.random.seed(bits + group_size)
    glu = SwitchGLU(256, 96, 8)
    nn.quantize(glu, group_size=group_size, bits=bits)
    glu.set_dtype(mx.float32)
    mx.eval(glu.parameters())
    return glu


@pytest.mark.parametrize("bits", [3, 4, 6, 8])
def test_packed_switch_glu_equals_mlx_lms_sorted_and_not(bits: int):
    """SwitchGLU calls its projections with x [B, L, 1, 1, K] and indices [B, L, k] (few
    tokens) or, from 64 indices on, sorted: x [B * L * k, 1, K], indices [B * L * k]."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlxd.models.packed import PackedSwitchLinear, pack_model

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    reference = _switch_glu(bits, 32)
    packed = _switch_glu(bits, 32)
    pack_model(packed)
    assert isinstance(reference.up_proj, QuantizedSwitchLinear)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(getattr(packed, name), PackedSwitchLinear)
    for tokens in (1, 3, 40):  # 3 x 2 = 6 indices: unsorted; 40 x 2 = 80: sorted
        x = mx.random.normal((2, tokens, 256), key=mx.random.key(tokens))
        indices = mx.argsort(mx.random.uniform(shape=(2, tokens, 8)), axis=-1)[..., :2]
        ours, theirs = packed(x, indices), reference(x, indices)
        assert ours.shape == theirs.shape == (2, tokens, 2, 256)
        _assert_close(np.array(ours), np.array(theirs), (bits, tokens))


def test_packed_switch_linear_adds_its_experts_bias():
    from mlx_lm.models.switch_layers import SwitchLinear

    from mlxd.models.packed import PackedSwitchLinear, pack_model

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    layer = SwitchLinear(64, 32, 4, bias=True)
    layer.bias = mx.random.normal((4, 32))
    reference = layer.to_quantized(group_size=32, bits=4)
    holder = nn.Module()
    holder.layer = layer.to_quantized(group_size=32, bits=4)
    pack_model(holder)
    assert isinstance(holder.layer, PackedSwitchLinear)
    x = mx.random.normal((3, 1, 1, 64))
    indices = mx.array([[0, 3], [1, 1], [2, 0]])
    _assert_close(np.array(holder.layer(x, indices)), np.array(reference(x, indices)), "bias")


def _greedy(model: nn.Module, prompt: list[int], steps: int = 12) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([tokens[-1:]]), cache=cache)
    return tokens


@pytest.mark.parametrize(
    "model_type, bits, group_size, dot",
    [
        ("qwen3_moe", 4, 64, False),
        ("mixtral", 8, 32, False),
        ("qwen3_moe", 6, 32, False),
        ("qwen3_moe", 4, 32, True),
        ("mixtral", 4, 64, True),
    ],
)
def test_tiny_moe_models_give_the_same_greedy_tokens_packed(model_type, bits, group_size, dot):
    """Built with mlx-lm's classes and quantized by mlx-lm, run as the loader runs them on the
    CPU (float32, packed; with `dot` on the int8 dot products, precise) and on MLX's own
    quantized path; the prompt is long enough (80 tokens x top 2) for SwitchGLU's sorted path,
    the decode steps take the unsorted one."""
    import importlib

    from mlx_lm.utils import quantize_model

    from mlxd.models.packability import experts_summary
    from mlxd.models.packed import PackedSwitchLinear, pack_model
    from tests.tiny_gguf import tiny_config

    if not kernels.available():
        pytest.fail("mlxd's CPU kernels did not build: python -m mlxd.kernels.build")
    config = tiny_config(model_type, hidden_size=128, intermediate_size=256)
    if model_type == "qwen3_moe":
        config["moe_intermediate_size"] = 64
    family = importlib.import_module(f"mlx_lm.models.{model_type}")

    def build() -> nn.Module:
        mx.random.seed(3)
        model = family.Model(family.ModelArgs.from_dict(config))
        model, _ = quantize_model(model, config, group_size, bits)
        model.set_dtype(mx.float32)
        return model

    reference, packed = build(), build()
    layers = config["num_hidden_layers"]
    assert experts_summary(packed) == (
        f"{3 * layers} quantized expert layers run packed on the kernels' gather matmul"
    )
    layers_packed, packed_here = pack_model(packed, dot=dot)
    switches = [m for _, m in packed.named_modules() if isinstance(m, PackedSwitchLinear)]
    assert len(switches) == 3 * layers and all(s.dot == dot for s in switches)
    # A later load takes the expert stacks from the packed cache as they are (models/packed_cache).
    again = build()
    assert pack_model(again, dot=dot, cached=dict(layers_packed)) == (layers_packed, 0)
    assert packed_here == len(layers_packed)
    names = [name for name, _ in tree_flatten(packed.parameters())]
    assert not [name for name in names if ".switch_mlp." in name and name.endswith("scales")]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 300, 80)]
    assert _greedy(packed, prompt) == _greedy(reference, prompt)


def test_unpackable_experts_are_said_to_stay_on_mlxs_quantized_matmul():
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlxd.models.packability import experts_summary

    glu = SwitchGLU(64, 96, 4)
    mxfp4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    nn.quantize(
        glu,
        group_size=32,
        bits=4,
        class_predicate=lambda path, m: (
            hasattr(m, "to_quantized") and (path != "down_proj" or mxfp4)
        ),
    )
    assert experts_summary(glu) == (
        "2 quantized expert layers run packed on the kernels' gather matmul; 1 quantized "
        "expert layers run on MLX's own quantized matmul, the kernels do not take them: "
        "mxfp4 quantization (the kernels take affine): down_proj"
    )
