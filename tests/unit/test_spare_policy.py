"""When a worker is kept imported ahead of the next load (control/spare_policy.py), and what
runtime/spare_worker.py does when its spare ended by itself."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mlxd.config import ModelConfig, ServerConfig
from mlxd.config.sections import DistributedConfig
from mlxd.control.model_runtime import ModelRuntime
from mlxd.control.spare_policy import QUIET_S, SPARE_BYTES, spare_wanted
from mlxd.runtime import spare_worker

NOW = 1000.0
PROCESS = ServerConfig(workers="process")


@dataclass
class Served:
    """What the policy reads of an engine: whether requests run, and since when it is quiet."""

    idle: bool = True
    last_used: float = 0.0
    failure: str | None = None
    memory_bytes: int = 0


def model(engine: Served | None = None, **fields: object) -> ModelRuntime:
    runtime = ModelRuntime("m", ModelConfig(source="/models/m", load="lazy"))
    runtime.engine = engine  # type: ignore[assignment]
    for name, value in fields.items():
        setattr(runtime, name, value)
    return runtime


def test_a_model_that_would_start_a_worker_gets_one_once_the_daemon_is_quiet():
    waiting = model()
    assert spare_wanted([waiting], PROCESS, NOW) == "spawn"
    assert spare_wanted([waiting, model(Served())], PROCESS, NOW) == "spawn"
    # Requests running, or the last one ended a moment ago: later (imports take a core).
    assert spare_wanted([waiting, model(Served(idle=False))], PROCESS, NOW) == "keep"
    recent = Served(last_used=NOW - QUIET_S / 2)
    assert spare_wanted([waiting, model(Served(), draining=[recent])], PROCESS, NOW) == "keep"
    # A model a reload removed, its engine still draining requests.
    gone = model(draining=[Served(idle=False)])
    assert spare_wanted([waiting], PROCESS, NOW, removed=[gone]) == "keep"
    # A worker that died is restarted in a new one.
    assert spare_wanted([model(Served(failure="killed"))], PROCESS, NOW) == "spawn"


def test_a_running_load_may_take_the_spare_so_it_is_kept():
    loading = model(loading=object())
    assert spare_wanted([loading], PROCESS, NOW) == "keep"
    assert spare_wanted([loading, model()], PROCESS, NOW) == "keep"


def test_no_spare_where_no_model_would_take_it():
    assert spare_wanted([], PROCESS, NOW) == "discard"
    assert spare_wanted([model(Served())], PROCESS, NOW) == "discard"  # every model loaded
    assert spare_wanted([model(gave_up=True, error="unsupported")], PROCESS, NOW) == "discard"
    ranks = model()
    ranks.config = ranks.config.model_copy(
        update={"distributed": DistributedConfig(hosts=["a", "b"])}
    )
    assert spare_wanted([ranks], PROCESS, NOW) == "discard"  # its ranks start their own
    assert spare_wanted([model()], ServerConfig(workers="inline"), NOW) == "discard"
    # A LoRA adapter whose base engine runs joins it.
    assert spare_wanted([model()], PROCESS, NOW, joins=lambda runtime: True) == "discard"


def test_a_spare_is_kept_only_where_the_memory_budget_has_room_for_it():
    """It holds memory while it waits: the budget counts it beside the engines."""
    budget = ServerConfig(workers="process", memory_budget=4 * 2**30)
    waiting = model()
    room = budget.budget_bytes - SPARE_BYTES
    assert spare_wanted([waiting, model(Served(memory_bytes=room))], budget, NOW) == "spawn"
    full = model(Served(memory_bytes=room + 1))
    assert spare_wanted([waiting, full], budget, NOW) == "discard"
    # A draining engine (a reloaded model's, or a removed one's) holds its memory too.
    draining = model(Served(memory_bytes=room // 2), draining=[Served(memory_bytes=room // 2 + 1)])
    assert spare_wanted([waiting, draining], budget, NOW) == "discard"
    gone = model(draining=[Served(memory_bytes=room + 1)])
    assert spare_wanted([waiting], budget, NOW, removed=[gone]) == "discard"
    # A dead engine's worker has exited: its memory is free, and its restart may take the spare.
    dead = model(Served(memory_bytes=room + 1, failure="killed"))
    assert spare_wanted([dead], budget, NOW) == "spawn"
    # A running load may take the one there is: kept, whatever the budget.
    assert spare_wanted([model(loading=object()), full], budget, NOW) == "keep"


@pytest.fixture
def no_spare() -> Iterator[None]:
    """The module's spare state as a daemon starts, restored after (one test's spare is
    killed, not left to the next)."""
    spare_worker.discard()
    yield
    spare_worker.discard()
    spare_worker._ended = False


def test_a_spare_that_ended_by_itself_is_not_replaced(
    no_spare: None, caplog: pytest.LogCaptureFixture
):
    spare_worker.keep()
    pid = spare_worker.pid()
    assert pid is not None
    spare_worker.keep()
    assert spare_worker.pid() == pid  # one at a time
    spare = spare_worker._spare
    assert spare is not None
    spare[0].send_signal(signal.SIGKILL)  # as the OOM killer would
    spare[0].wait()
    with caplog.at_level(logging.WARNING, "mlxd.worker"):
        spare_worker.keep()
    assert spare_worker.pid() is None and spare_worker.take() is None
    assert "workers now start with their model" in caplog.text


def test_a_spare_that_cannot_be_spawned_is_given_up_on_without_raising(
    no_spare: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    # keep() runs on the daemon's ticker: an exception there would stop every later tick.
    def no_fork(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(spare_worker.subprocess, "Popen", no_fork)
    with caplog.at_level(logging.WARNING, "mlxd.worker"):
        spare_worker.keep()
        spare_worker.keep()
    assert spare_worker.pid() is None
    assert caplog.text.count("could not be started ([Errno 12] Cannot allocate memory)") == 1
