"""What the built kernel module holds that no result shows. A prefetch changes only the speed,
so no correctness test notices it gone: GCC 12 once deleted every one of them (csrc/simd.h's
`prefetch_block` as a function of its own), and a Llama-3.2-1B-shaped model served 8 streams
at 138 tok/s instead of 226 on a Zen 5. The aarch64 build's: test_kernel_neon.py."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest

from mlxd import kernels
from mlxd.kernels.build import module_path
from tests.conftest import NOT_APPLICABLE

# A prefetch instruction in objdump's disassembly, by machine.
PREFETCH = {
    "x86_64": re.compile(r"\tprefetcht0\s"),
    "aarch64": re.compile(r"\tprfm\s"),
}


def prefetches(disassembly: str, machine: str) -> int:
    return len(PREFETCH[machine].findall(disassembly))


def disassemble(path: str, objdump: str = "objdump") -> str:
    tool = shutil.which(objdump)
    if tool is None:
        pytest.skip(f"{NOT_APPLICABLE} no {objdump} (binutils, as the kernels' build uses)")
    done = subprocess.run(
        [tool, "-d", "--no-show-raw-insn", path],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return done.stdout


def test_the_matmul_kernels_prefetch_their_weights() -> None:
    machine = platform.machine().replace("arm64", "aarch64")
    if machine not in PREFETCH:
        pytest.skip(f"{NOT_APPLICABLE} no prefetch pattern for {machine}")
    if not kernels.available():
        pytest.skip(f"{NOT_APPLICABLE} the kernels are not built (python -m mlxd.kernels.build)")
    # Each ISA variant's float and int8 matmuls, for every row count and width: thousands
    # (3,968 on x86-64 when written); none at all when the compiler dropped them.
    found = prefetches(disassemble(str(module_path())), machine)
    assert found >= 100, f"{module_path()} holds {found} prefetch instructions"
