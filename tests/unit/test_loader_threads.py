"""A model loaded on one thread runs on another (the worker loads on a helper thread and
generates on the engine's): load_llm leaves no lazy array tied to the loading thread's stream,
nor does a GGUF's conversion leave one in what it hands the load (each `asyncio.to_thread` of a
worker may land on another thread, and MLX's default streams are per thread)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from tests.tiny_gguf import tiny_config, tiny_weights, write_gguf
from tests.unit.test_gguf_models import LLAMA3


def _in_thread(work: Any) -> Any:
    """`work()` on a fresh thread with its own stream, as the worker's threads run; its
    result, or the exception it raised."""
    import mlx.core as mx

    box: list[Any] = []

    def target() -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                box.append(work())
        except Exception as exc:  # handed back to the test
            box.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return box[0]


def test_a_gguf_converted_on_one_thread_loads_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    from mlxd.models import fresh_weights
    from mlxd.models.fresh_weights import PackLayout
    from mlxd.models.loader import load_llm
    from mlxd.models.sources import resolve_source

    monkeypatch.setattr(fresh_weights, "room_to_hold", lambda: True)  # whatever this machine has
    config = tiny_config("llama", hidden_size=256, intermediate_size=512)
    write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), Q.Q4_K)

    def convert() -> Path:
        # Packed as it converts, each group (q, k, v; gate, up) as views of one matrix.
        with fresh_weights.packing(PackLayout(dot=False, precise=True)):
            return resolve_source(str(tmp_path / "m.gguf"), model_name="m", cache_dir=tmp_path)

    model_dir = _in_thread(convert)
    assert not isinstance(model_dir, Exception), model_dir
    loaded = _in_thread(lambda: load_llm(model_dir, model_name="m"))
    assert not isinstance(loaded, Exception), loaded
    failure = _in_thread(lambda: mx.eval(loaded.model(mx.array([[1, 2, 3]]))))
    assert not isinstance(failure, Exception), failure  # mx.eval returns None


def test_a_llama3_model_loaded_on_one_thread_generates_on_another(tmp_path: Path):
    import mlx.core as mx

    from mlxd.models.gguf import convert_gguf
    from mlxd.models.loader import load_llm

    # Llama 3's rope keeps its scaled frequencies in a private (non-parameter) array.
    config = tiny_config(
        "llama",
        hidden_size=128,
        intermediate_size=256,
        rope_scaling=LLAMA3,
        max_position_embeddings=131072,
    )
    write_gguf(tmp_path / "m.gguf", config, tiny_weights(config), Q.Q4_0)
    (tmp_path / "model").mkdir()
    convert_gguf(tmp_path / "m.gguf", tmp_path / "model")
    loaded = _in_thread(lambda: load_llm(tmp_path / "model", model_name="m"))
    assert not isinstance(loaded, Exception), loaded

    def forward() -> Any:
        logits = loaded.model(mx.array([[1, 2, 3]]))
        mx.eval(logits)
        return logits

    logits = _in_thread(forward)
    assert not isinstance(logits, Exception), logits
    assert logits.shape[:2] == (1, 3)
