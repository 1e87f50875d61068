"""Both servers held to a smaller ISA than the CPU has: a stand-in for the CPUs without AVX-512
most home labs own when the machine at hand has it.

`--isa avx2` (benchmarks.compare, benchmarks.prefix_cache, benchmarks.real_shapes): AVX2, FMA
and F16C, as AMD Zen 2/3 have. `--isa avxvnni`: those and AVX-VNNI (256-bit int8 dot products),
as Intel's consumer cores since Alder Lake have; only a CPU with `avx_vnni` runs it. mlxd runs
its kernels' variant of that name (MLXD_KERNELS_ISA, in the servers' environment and this
process's, so the printed machine line says so) and OpenBLAS its Haswell kernels (what it picks
on such a CPU), and llama.cpp a build of the same source with those instructions and without
AVX-512, made once beside ../shared/tools/build-llama-server's native build (`build-<isa>`,
about 10 minutes on 2 cores). An explicit `--llama-server` is taken as that build.
mlx_lm.server (the `baseline` peer) is not held: MLX's own CPU code is built for the machine it
runs on. The CPU still brings its own memory and caches: the stand-in shows the code's side, not
another CPU's figures (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# GGML_NATIVE off, so the compiler targets exactly these; AMX off as build-llama-server has it.
_BUILD = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# llama.cpp's cmake options for each held ISA, beside _BUILD.
BUILDS = {"avx2": ("-DGGML_AVX_VNNI=OFF",), "avxvnni": ("-DGGML_AVX_VNNI=ON",)}
ISAS = tuple(BUILDS)


def add_argument(parser: argparse.ArgumentParser) -> None:
    """The benchmarks' `--isa` option."""
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default=None,
        help="hold mlxd and llama.cpp to this ISA (benchmarks/held_isa.py: a stand-in for a "
        "CPU without AVX-512)",
    )


def hold_mlxd_to(isa: str) -> None:
    """mlxd's kernels on `isa` here and in every server started after (their environment is
    this process's)."""
    from mlxd import kernels

    if not kernels.available():
        raise SystemExit(f"--isa {isa}: mlxd's CPU kernels are not built (make bootstrap)")
    if isa not in kernels.isas():
        raise SystemExit(f"--isa {isa}: this CPU runs {kernels.isas()}")
    os.environ[kernels.ISA_ENV] = isa
    kernels.use_isa(isa)
    # Before server_env(), which picks SkylakeX on an AVX-512 CPU unless one is set.
    os.environ["OPENBLAS_CORETYPE"] = "Haswell"


def held_llama_server_build(isa: str, native: Path) -> Path:
    """llama-server built for `isa` without AVX-512 from the source tree of the `native` build
    (<source>/build/bin/llama-server), once."""
    source = native.resolve().parents[2]
    build = f"build-{isa}"
    binary = source / build / "bin" / "llama-server"
    if binary.exists():
        return binary
    if not (source / "CMakeLists.txt").exists():
        raise SystemExit(
            f"--isa {isa}: {native} is not in a llama.cpp source tree; "
            f"pass a build for {isa} as --llama-server"
        )
    print(f"building llama-server for {isa} in {source / build} (once)", flush=True)
    subprocess.run(
        ["cmake", "-B", build, "-G", "Ninja", *_BUILD, *BUILDS[isa]],
        cwd=source,
        check=True,
        stdout=sys.stderr,
    )
    subprocess.run(
        ["cmake", "--build", build, "--target", "llama-server", f"-j{os.cpu_count()}"],
        cwd=source,
        check=True,
        stdout=sys.stderr,
    )
    return binary


def held_llama_server(isa: str | None, explicit: Path | None, found: Path | None) -> Path | None:
    """The llama-server to run: `found` (`explicit`, or the native build), rebuilt for `isa`
    where one is held and the binary was not given explicitly."""
    if isa is None or explicit is not None or found is None:
        return found
    return held_llama_server_build(isa, found)
