"""mlxd's modules import downwards only: types and config at the bottom, the HTTP API and the
CLI on top. A module that reaches up (the scheduler importing an engine, an engine importing the
API) fails here, naming the import."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxd

PACKAGE = Path(mlxd.__file__).parent

# Lowest first. A module may import from its own layer and the ones below it.
# `parsers` sits at the bottom with `config`, which checks parser names against its registry.
LAYERS: list[set[str]] = [
    {
        "types",
        "errors",
        "config",
        "settings",
        "accel",
        "logs",
        "process_exit",
        "parsers",
        "kernels",
    },
    {"cache", "scheduler", "models", "constrain", "media", "distributed"},
    {"engines"},
    {"registry"},
    {"daemon"},
    {"api"},
    {"cli", "client", "loadgen", "__main__"},
]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("mlxd.") else module
    for index, members in enumerate(LAYERS):
        if top in members:
            return index
    raise AssertionError(f"mlxd.{top} is in no layer: add it to LAYERS")


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlxd"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if a.name.startswith("mlxd"))
    return found


def test_every_module_imports_only_its_layer_or_below():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        if module == "mlxd":
            continue
        for imported in imports(path):
            if imported != "mlxd" and layer_of(imported) > layer_of(module):
                violations.append(f"{module} imports {imported}")
    assert violations == []
