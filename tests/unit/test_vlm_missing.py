"""A `kind: vlm` model without mlx-vlm installed fails to load with the install hint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlxd.errors import ModelLoadError
from mlxd.worker.vlm import load_vlm


def test_missing_mlx_vlm_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    # None in sys.modules makes `import mlx_vlm...` raise ImportError, as when not installed.
    for name in [m for m in sys.modules if m == "mlx_vlm" or m.startswith("mlx_vlm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlx_vlm", None)
    with pytest.raises(ModelLoadError) as caught:
        load_vlm(tmp_path, dtype="auto", model_name="eyes")
    assert "model 'eyes'" in caught.value.message
    assert "pip install 'mlxd[vlm]'" in caught.value.message
    assert caught.value.status == 503
