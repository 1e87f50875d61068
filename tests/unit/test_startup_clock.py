"""The daemon's own start-up time (`daemon up in … s`, /v1/status) to the clock tick: psutil's
process start adds Linux's boot time, which is given in whole seconds."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

CHILD = """
import psutil
from mlxd.daemon import _seconds_since_start
print(_seconds_since_start(psutil.Process()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc clock ticks: Linux")
def test_a_process_knows_how_long_ago_it_started_to_the_tick():
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    lived = time.monotonic() - started
    since_start = float(out.stdout)
    tick = 0.01  # the start time's resolution (USER_HZ 100)
    assert 0 < since_start <= lived + 2 * tick
