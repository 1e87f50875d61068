"""Where a CUDA worker has MLX keep its compiled kernels."""

from __future__ import annotations

import os
from importlib.metadata import version

from mlxd.worker import jit_cache


def test_on_cuda_the_kernels_are_kept_under_cache_dir_per_mlx_version(monkeypatch, tmp_path):
    monkeypatch.delenv(jit_cache.ENV, raising=False)
    monkeypatch.setattr(jit_cache, "backend_name", lambda: "cuda")
    folder = jit_cache.keep_jit_cache(tmp_path)
    assert folder is not None and folder.is_dir()
    assert folder.parent == tmp_path / "mlx-jit" and folder.name.startswith(version("mlx") + "-")
    assert os.environ[jit_cache.ENV] == str(folder)


def test_a_folder_the_user_chose_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv(jit_cache.ENV, "/srv/ptx")
    monkeypatch.setattr(jit_cache, "backend_name", lambda: "cuda")
    assert jit_cache.keep_jit_cache(tmp_path) is None
    assert os.environ[jit_cache.ENV] == "/srv/ptx"


def test_the_cpu_backend_compiles_nothing_to_keep(monkeypatch, tmp_path):
    monkeypatch.delenv(jit_cache.ENV, raising=False)
    monkeypatch.setattr(jit_cache, "backend_name", lambda: "cpu")
    assert jit_cache.keep_jit_cache(tmp_path) is None
    assert jit_cache.ENV not in os.environ and not (tmp_path / "mlx-jit").exists()


def test_an_unwritable_cache_dir_leaves_mlx_its_default(monkeypatch, tmp_path):
    monkeypatch.delenv(jit_cache.ENV, raising=False)
    monkeypatch.setattr(jit_cache, "backend_name", lambda: "cuda")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert jit_cache.keep_jit_cache(blocker) is None
    assert jit_cache.ENV not in os.environ
