"""mlxd's modules import downwards only: types and config at the bottom, the HTTP API and the
CLI on top. A module that reaches up (the executor importing an engine, an engine importing the
API) fails here, naming the import. The daemon side (runtime, control, daemon, api) never
imports the worker side, and loading the whole daemon loads no MLX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mlxd

PACKAGE = Path(mlxd.__file__).parent

# Lowest first. A module may import from its own layer and the ones below it.
# `parsers` sits at the bottom with `config`, which checks parser names against its config.
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
        "ollama_store",
        "memory_need",
    },
    {"scheduler", "audio"},
    {"cache", "executor", "models", "constrain", "media", "distributed"},
    {"worker", "runtime"},
    {"control"},
    {"daemon"},
    {"api"},
    {"cli", "__main__"},
    {"testing"},  # test hooks: loaded by name (MLXD_WORKER_HOOKS), imported by no module
]
# What the daemon process runs; none of it may import the worker side (or MLX).
DAEMON_SIDE = {"runtime", "control", "daemon", "api"}
WORKER_SIDE = {"worker", "executor", "cache", "kernels", "constrain", "media"}


def top_of(module: str) -> str:
    return module.split(".")[1] if module.startswith("mlxd.") else module


def layer_of(module: str) -> int:
    top = top_of(module)
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


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        if module != "mlxd":
            found.append((module, path))
    return found


def test_every_module_imports_only_its_layer_or_below():
    violations = []
    for module, path in modules():
        for imported in imports(path):
            if imported != "mlxd" and layer_of(imported) > layer_of(module):
                violations.append(f"{module} imports {imported}")
    assert violations == []


def test_the_daemon_side_never_imports_the_worker_side():
    violations = []
    for module, path in modules():
        if top_of(module) in DAEMON_SIDE:
            violations += [
                f"{module} imports {imported}"
                for imported in imports(path)
                if top_of(imported) in WORKER_SIDE
            ]
    assert violations == []


def test_no_module_imports_the_testing_package():
    users = [
        f"{module} imports {imported}"
        for module, path in modules()
        if top_of(module) != "testing"
        for imported in imports(path)
        if top_of(imported) == "testing"
    ]
    assert users == []


def test_the_daemon_loads_no_mlx():
    """Every daemon-side module, the app and the CLI, imported in a fresh interpreter."""
    daemon_modules = [m for m, _ in modules() if top_of(m) in DAEMON_SIDE | {"cli"}]
    script = (
        "import importlib, sys\n"
        f"for name in {daemon_modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'mlx', 'mlx_lm', 'mlx_vlm', 'mlx_embeddings', 'mlx_audio'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]", out


DIALECTS = {"openai", "anthropic", "ollama", "ops"}


def dialect_of(module: str) -> str | None:
    """'openai' for mlxd.api.openai.chat; 'shared' for api/common and api/middleware."""
    parts = module.split(".")
    if len(parts) < 3 or parts[:2] != ["mlxd", "api"]:
        return None
    return parts[2] if parts[2] in DIALECTS else "shared" if parts[2] != "app" else None


def test_no_dialect_imports_another_and_shared_code_knows_none():
    """Each dialect stands on api/common and api/middleware alone; only app.py assembles them,
    so adding a dialect touches no shared module."""
    violations = []
    for module, path in modules():
        own = dialect_of(module)
        if own is None:
            continue
        for imported in imports(path):
            other = dialect_of(imported)
            if other in DIALECTS and other != own:
                violations.append(f"{module} imports {imported}")
    assert violations == []


# The private modules mlxd imports: mlx's launcher (`mlx.launch`), whose stdin-forwarding
# select would otherwise spin a fifth of a core per idle group (see distributed/launcher.py);
# for type checking only, the TypedDict of options llguidance's public
# `grammar_from_json_schema` takes, which its stub alone declares.
PRIVATE_IMPORTS_ALLOWED = {
    ("mlxd.distributed.launcher", "mlx._distributed_utils"),
    ("mlxd.constrain.grammar", "llguidance._lib"),
}


def private_imports(path: Path) -> list[str]:
    """Another library's private modules or names a module imports (`_x` anywhere in the
    dotted path, or an imported `_name`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("mlxd"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [
                a.name
                for a in node.names
                if not a.name.startswith("mlxd")
                and any(part.startswith("_") for part in a.name.split("."))
            ]
    return found


def test_no_module_imports_another_librarys_private_parts():
    found = {
        (module, name)
        for module, path in modules()
        for name in private_imports(path)
        if not name.startswith("__future__")
    }
    assert found - PRIVATE_IMPORTS_ALLOWED == set()


def test_no_mlxd_class_subclasses_mlx_lms_batches():
    """mlxd's batch engine stands on mlx-lm's models and cache classes, not its generator."""
    for module, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "mlx_lm.generate":
                names = {a.name for a in node.names}
                assert names <= {"generation_stream"}, f"{module} imports {names}"
