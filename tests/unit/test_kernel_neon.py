"""The aarch64 kernel variants (generic, neon, neondot) on an x86 machine: compiled from csrc/ with
Debian's cross compiler (g++-aarch64-linux-gnu, which also proves the aarch64 build includes
no x86 header) and checked against float64 references under qemu-user
(tests/native/kernel_check.cpp). On aarch64 the other kernel tests run them natively."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import NOT_APPLICABLE
from tests.unit.test_kernel_build import disassemble, prefetches

ROOT = Path(__file__).resolve().parents[2]
CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# The per-variant sources, as csrc/CMakeLists.txt lists them (one list to keep).
_LISTED = re.search(r"set\(KERNEL_SOURCES([^)]*)\)", (ROOT / "csrc/CMakeLists.txt").read_text())
assert _LISTED is not None
SOURCES = _LISTED.group(1).split()
# As csrc/CMakeLists.txt: (flags, the vector family the variant's code is written for).
FLAGS = {
    "generic": ([], "GENERIC"),
    "neon": (["-march=armv8-a+simd"], "NEON"),
    "neondot": (["-march=armv8.2-a+dotprod"], "NEON"),
}


def test_the_aarch64_variants_compute_right_under_qemu(tmp_path: Path) -> None:
    if platform.machine() in ("aarch64", "arm64"):
        pytest.skip(f"{NOT_APPLICABLE} an aarch64 machine runs these variants natively")
    if shutil.which(CXX) is None or shutil.which(QEMU) is None:
        pytest.skip(
            f"{NOT_APPLICABLE} no {CXX} or {QEMU} "
            "(make system-deps installs g++-aarch64-linux-gnu and qemu-user)"
        )
    csrc = ROOT / "csrc"
    objects = []
    for variant, (flags, family) in FLAGS.items():
        for source in SOURCES:
            out = tmp_path / f"{variant}-{source}.o"
            subprocess.run(
                [CXX, "-std=c++17", "-O2", "-ffp-contract=fast", "-fno-trapping-math",
                 "-fopenmp-simd", *flags, f"-DMLXD_ISA={variant}",
                 f"-DMLXD_ISA_{family}=1", "-c", str(csrc / source), "-o", str(out)],
                check=True,
                timeout=300,
            )  # fmt: skip
            objects.append(str(out))
            if source in ("qdot.cpp", "qmatmul.cpp"):  # the weights' look-ahead survived
                found = prefetches(disassemble(str(out), "aarch64-linux-gnu-objdump"), "aarch64")
                assert found > 0, f"{variant} {source}: no prefetch instruction"
    program = tmp_path / "kernel_check"
    subprocess.run(
        [CXX, "-std=c++17", "-O2", "-static", "-pthread", f"-I{csrc}",
         str(ROOT / "tests/native/kernel_check.cpp"), str(csrc / "threads.cpp"), *objects,
         "-o", str(program)],
        check=True,
        timeout=300,
    )  # fmt: skip
    done = subprocess.run([QEMU, str(program)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[-4:-1] == ["generic: ok", "neon: ok", "neondot: ok"], done.stdout
