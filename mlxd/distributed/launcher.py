"""`python -m mlxd.distributed.launcher ARGS`: MLX's own `mlx.launch ARGS`, without its spin.

mlx.launch gives every rank a thread that `select`s on the rank's stdout, stderr and stdin;
a pipe's write end is always writable, so that `select` returns at once, forever: each idle
group burns about a fifth of a core (measured on a 2-core machine) for as long as the model
stays loaded. mlxd never writes to the ranks' stdin, so here those selects wait on the
outputs alone. Everything else (hostfiles, ssh, the ring/JACCL wiring) is mlx.launch's.
"""

from __future__ import annotations

import select
import sys
from typing import Any

from mlx._distributed_utils import launch


def _outputs_only(rlist: Any, wlist: Any, xlist: Any, timeout: float | None = None) -> Any:
    del wlist  # the ranks' stdin: nothing to forward, and always writable
    return select.select(rlist, [], xlist, timeout)


def main() -> None:
    launch.select = _outputs_only
    sys.argv[0] = "mlx.launch"
    sys.exit(launch.main())


if __name__ == "__main__":
    main()
