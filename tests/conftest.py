import os
from pathlib import Path

import pytest

# Under CI a skipped test is a failed one: a missing browser, weights or library must not
# pass quietly. A test that does not apply to the machine says so with this prefix.
NOT_APPLICABLE = "not applicable here:"


# Lines of a daemon's log a failed test's report carries (its access log left out).
LOG_TAIL = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _attach_daemon_logs(item, report)
    if os.environ.get("CI") != "true" or not report.skipped:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not reason.removeprefix("Skipped: ").startswith(NOT_APPLICABLE):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which must run every test: {reason}"


def _attach_daemon_logs(item: pytest.Item, report: pytest.TestReport) -> None:
    """The end of every daemon's log the test used: a worker's crash (faulthandler's stacks,
    "killed by SIGSEGV") is there, not in the test's own output."""
    for name, value in getattr(item, "funcargs", {}).items():
        log_path = getattr(value, "log_path", None)
        if not isinstance(log_path, Path) or not log_path.is_file():
            continue
        lines = [
            line
            for line in log_path.read_text(errors="replace").splitlines()
            if " mlxd.access: " not in line
        ]
        # A worker crash's dump (faulthandler) is kept too, however much was logged after it.
        tail = max(len(lines) - LOG_TAIL, 0)
        crash = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), tail)
        dump = lines[min(crash, tail) : min(crash + LOG_TAIL, tail)]
        kept = [*dump, "[...]", *lines[tail:]] if dump else lines[tail:]
        report.sections.append((f"daemon log ({name}: {log_path})", "\n".join(kept)))


@pytest.fixture(scope="session")
def mlxd_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir per test session, so the demo GGUF is converted once."""
    return tmp_path_factory.mktemp("mlxd-cache")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory, mlxd_cache_dir: Path) -> Path:
    """A tiny random-weight Qwen2-VL model directory (see tests/tiny_vlm.py)."""
    from tests.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"), mlxd_cache_dir)


@pytest.fixture(scope="session")
def tiny_tts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight KittenTTS model directory (see tests/tiny_tts.py)."""
    from tests.tiny_tts import build_tiny_tts

    return build_tiny_tts(tmp_path_factory.mktemp("tiny-tts"))
