"""Under CI=true a skipped test fails the run, unless it says it does not apply to the machine
(tests/conftest.py): a missing browser or missing weights must not pass quietly."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def test_missing_dependency():
    pytest.skip("chromium is not installed")

def test_other_machine():
    pytest.skip("not applicable here: the CPU has no AVX-512")

def test_runs():
    assert True
"""


@pytest.mark.parametrize(("ci", "failed", "skipped"), [("true", 1, 1), ("", 0, 2)])
def test_skips_fail_only_under_ci(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str, failed: int, skipped: int
) -> None:
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(TESTS)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=1, failed=failed, skipped=skipped)
    if failed:
        result.stdout.fnmatch_lines(["*skipped under CI=true*chromium is not installed*"])
