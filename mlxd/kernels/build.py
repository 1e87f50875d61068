"""Build mlxd's CPU kernels (csrc/) against the installed MLX: `python -m mlxd.kernels.build`.

`make` runs this after installing the package. The module lands next to this file as
`_cpu.<abi>.so`, with the kernels compiled once per ISA variant of the architecture (explicit
target flags, no -march=native) and the best variant chosen at run time, so it runs on any CPU
of its architecture it is copied to. It needs a C++ compiler,
CMake and nanobind at the ABI MLX was built with; without them mlxd still runs (float32
weights on the CPU, as before), which `mlxd.kernels.available()` reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import mlx

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_DIR = PACKAGE_DIR.parent.parent / "csrc"


def module_path() -> Path:
    return PACKAGE_DIR / f"_cpu{sysconfig.get_config_var('EXT_SUFFIX')}"


def build() -> Path:
    mlx_cmake = Path(mlx.__path__[0]) / "share" / "cmake" / "MLX"
    with tempfile.TemporaryDirectory(prefix="mlxd-kernels-") as build_dir:
        subprocess.run(
            [
                "cmake",
                "-S",
                str(SOURCE_DIR),
                "-B",
                build_dir,
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DMLX_DIR={mlx_cmake}",
                f"-DPython_EXECUTABLE={sys.executable}",
                f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build_dir}/out",
            ],
            check=True,
        )
        subprocess.run(["cmake", "--build", build_dir, "-j"], check=True)
        # A rename, not an overwrite: processes that loaded the old module keep their copy.
        os.replace(Path(build_dir) / "out" / module_path().name, module_path())
    return module_path()


if __name__ == "__main__":
    print(build())
