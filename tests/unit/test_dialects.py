"""The seam between the app and its API dialects: each dialect package declares itself, and
none imports another (a new dialect is a new folder, not an edit of shared code)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mlxd.api.common.dialect import discover

API = Path(__file__).parents[2] / "mlxd" / "api"
DIALECTS = ("anthropic", "ollama", "openai", "ops")


def test_every_dialect_package_is_found():
    found = discover()
    assert [d.name for d in found] == list(DIALECTS)
    names = [bp.name for d in found for bp in d.blueprints]
    assert len(names) == len(set(names))


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


@pytest.mark.parametrize("dialect", DIALECTS)
def test_no_dialect_imports_another(dialect: str):
    others = [f"mlxd.api.{other}" for other in DIALECTS if other != dialect]
    for path in (API / dialect).rglob("*.py"):
        for module in _imports(path):
            assert not any(module == o or module.startswith(f"{o}.") for o in others), (
                f"{path.relative_to(API)} imports {module}"
            )


@pytest.mark.parametrize("shared", ["common", "middleware"])
def test_shared_code_imports_no_api_dialect(shared: str):
    # `ops` (metrics, the dashboard) is the daemon's own, which the middleware feeds.
    for path in (API / shared).rglob("*.py"):
        for module in _imports(path):
            assert not any(module.startswith(f"mlxd.api.{d}") for d in DIALECTS[:3]), (
                f"{path.relative_to(API)} imports {module}"
            )
