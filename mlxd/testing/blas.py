"""A pytest plugin (pyproject's addopts: `-p mlxd.testing.blas`): pytest re-executes itself
with the BLAS preload mlxd gives itself (mlxd/accel.py), as a plugin named with `-p` is
imported before pytest captures any output. Without it the tests' in-process float32 models
ran on MLX's reference BLAS: SmolLM2's greedy-tokens test took 136 s instead of 15 on a 2-core
AVX2 EPYC.

The re-executed pytest puts back the environment it was started with, so the processes the
tests start (daemons, qemu, chromium) see a user's environment: a daemon re-executes itself as
it does for a user.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mlxd import accel

_STARTED_WITH = "MLXD_TEST_ENV"

if _STARTED_WITH in os.environ:
    started_with = json.loads(os.environ[_STARTED_WITH])
    os.environ.clear()
    os.environ.update(started_with)
elif Path(sys.argv[0]).name == "pytest" or Path(sys.argv[0]).parent.name == "pytest":
    # Started as `pytest` or `python -m pytest`: the command can be run again as the latter
    # (not so from a program that calls pytest.main; it runs the tests as it started them).
    os.environ[_STARTED_WITH] = json.dumps(dict(os.environ))
    accel.ensure_optimized_blas("pytest")
    del os.environ[_STARTED_WITH]  # nothing to change: not re-executed
