"""The kernels' own thread pool (csrc/parallel.h, threads.cpp): the same results on any number
of threads, and from several streams at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxd import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

SETUP = """
import os, threading
import mlx.core as mx
from mlxd import kernels
mx.random.seed(0)
weight, scales, biases = mx.quantize(mx.random.normal((512, 576)), group_size=32, bits=4)
packed = kernels.pack(weight, scales, biases, 32, 4)
x = mx.random.normal((40, 576))  # above the buffered-pass threshold: both loops of qmatmul
mx.eval(packed.weight, packed.scale_bias, x)
def product(threads):
    kernels.set_threads(threads)
    y = kernels.qmatmul(x, packed)
    mx.eval(y)
    return y
alone = product(1)
"""


def run(script: str) -> None:
    subprocess.run([sys.executable, "-c", SETUP + script], check=True, timeout=120)


def test_any_thread_count_gives_the_same_bits() -> None:
    run("""
for threads in (2, 3, 8):
    for _ in range(20):
        assert mx.array_equal(product(threads), alone).item(), threads
""")


def test_streams_running_kernels_at_once_share_the_pool() -> None:
    # Two Python threads, each on its own stream, with every stream allowed several threads:
    # one holds the pool, the other's kernel runs on its own thread meanwhile.
    run("""
kernels.set_threads(2)
failures = []
def work():
    stream = mx.new_stream(mx.cpu)
    with mx.stream(stream):
        for _ in range(50):
            y = kernels.qmatmul(x, packed)
            mx.eval(y)
            if not mx.array_equal(y, alone).item():
                failures.append(1)
workers = [threading.Thread(target=work) for _ in range(2)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
assert not failures
""")


def test_one_row_kernels_can_leave_a_core() -> None:
    """`set_spare_core_rows`: kernels over that many rows or fewer run on a thread fewer (at
    least one), the same bits; larger ones on every thread."""
    script = (
        SETUP
        + """
kernels.set_threads(2)
one_row = x[:1]
every = kernels.qmatmul(one_row, packed)
assert kernels.threads_for_rows(1) == 2
kernels.set_spare_core_rows(1)
assert kernels.threads_for_rows(1) == 1 and kernels.threads_for_rows(2) == 2
assert mx.array_equal(kernels.qmatmul(one_row, packed), every).item()
kernels.set_threads(1)
assert kernels.threads_for_rows(1) == 1  # never none
kernels.set_spare_core_rows(0)
kernels.set_threads(4)
assert kernels.threads_for_rows(1) == 4
print("ok")
"""
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
