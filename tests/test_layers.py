"""A layer imports only the layers below it: specs < state < controller, workers < client (mortal.client).

Checked on the source (every `import` / `from ... import`, also inside functions), as kopf's
import-linter contracts do, so a shortcut across layers fails here before it spreads. The public
facade (`mortal`, `mortal.rewards`) sits on top and may import anything. The only modules below the
client that import it are the shims left at the client's old paths (SHIMS), which warn and re-export.
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "specs": "mortal.specs",
    "state": "mortal.state",
    "controller": "mortal.controller",
    "workers": "mortal.workers",
    "mortal": "mortal",
}
CLIENT = "mortal.client"
FACADE = ("mortal", "mortal.rewards")

ALLOWED = {
    "mortal.specs": {"mortal.specs"},
    "mortal.state": {"mortal.specs", "mortal.state"},
    "mortal.workers": {"mortal.specs", "mortal.state", "mortal.workers"},
    "mortal.controller": {"mortal.specs", "mortal.state", "mortal.controller"},
    CLIENT: {"mortal.specs", "mortal.state", "mortal.controller", "mortal.workers", CLIENT},
}

# The client's old paths under mortal.controller (old -> new): each warns with a DeprecationWarning and
# re-exports the new module's public names. Nothing else below the client may import it.
SHIMS = {
    "mortal.controller.trainer": ("mortal.client.trainer",),
    "mortal.controller.trainer_inputs": ("mortal.client.trainer_inputs",),
    "mortal.controller.modes": ("mortal.client.modes",),
    "mortal.controller.modal_app": ("mortal.client.modal_app",),
    "mortal.controller.cli": ("mortal.client.cli",),
    **{
        f"mortal.controller.cli.{name}": (f"mortal.client.cli.{name}",)
        for name in (
            "completions",
            "context",
            "dashboard",
            "dashboard_data",
            "dashboard_html",
            "follow",
            "get",
            "main",
            "metrics",
            "output",
            "scale",
            "text",
        )
    },
    "mortal.controller.cli.apply": ("mortal.client.apply", "mortal.client.cli.apply"),
    "mortal.controller.cli.cp": ("mortal.client.checkpoint_copy", "mortal.client.cli.cp"),
    "mortal.controller.cli.fork": ("mortal.client.fork", "mortal.client.rollback", "mortal.client.cli.fork"),
}


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    if module in FACADE:
        return module
    return ".".join(module.split(".")[:2])


def mortal_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.startswith("mortal.")}


SOURCES = sorted(
    p for folder in FOLDERS for p in (REPO / folder).rglob("*.py") if "migrations" not in p.parts
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_imports_only_lower_layers(path):
    name = module_name(path)
    own = layer(name)
    if own in FACADE:
        return
    allowed = ALLOWED[own] | ({CLIENT} if name in SHIMS else set())
    wrong = {imported for imported in mortal_imports(path) if layer(imported) not in allowed}
    assert not wrong, f"{name} ({own}) must not import {sorted(wrong)}"


def test_the_client_library_leaves_the_command_line_to_its_verbs():
    """mortal.client's library (fork, rollback, apply, ...) is what the verbs and MortalTrainer call: it never
    imports the CLI package, but for the live view MortalTrainer.train() shares with `apply --follow`."""
    library = [
        p for p in (REPO / "mortal" / "client").rglob("*.py") if "cli" not in p.relative_to(REPO).parts
    ]
    for path in library:
        named = set()  # `from mortal.client.cli import follow` names mortal.client.cli.follow
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named |= {f"{node.module}.{alias.name}" for alias in node.names}
        cli = {name for name in named if name.startswith("mortal.client.cli.")}
        assert cli <= {"mortal.client.cli.follow"}, f"{module_name(path)} imports {sorted(cli)}"


def test_every_shim_is_a_module_and_imports_only_the_client():
    for name in SHIMS:
        path = REPO / "controller" / Path(*name.split(".")[2:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        assert path.is_file(), f"{name}: no shim at {path}"
        assert {layer(imported) for imported in mortal_imports(path)} <= {CLIENT}, name


def _fresh_import(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    """`import name` in this file as a first import would run it (its shim run again), with the warnings."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        sys.modules.pop(loaded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {name}", __file__, "exec"), {})
    return sys.modules[name], caught


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_each_shim_warns_and_reexports_the_moved_module(old, monkeypatch):
    monkeypatch.setenv("MORTAL_MODAL_SECRETS", "")
    shim, caught = _fresh_import(old)
    moved = [
        w for w in caught if issubclass(w.category, DeprecationWarning) and f"{old} moved" in str(w.message)
    ]
    assert [str(w.message) for w in moved] == [
        f"{old} moved to {', '.join(SHIMS[old])}; import it from there"
    ]
    assert moved[0].filename == __file__, "the warning names the importing line, not the shim"
    for new in SHIMS[old]:
        module = importlib.import_module(new)
        public = [
            n for n in vars(module) if not n.startswith("_") and f"{old}.{n}" not in SHIMS
        ]  # not its shims
        missing = [n for n in public if getattr(shim, n, None) is not getattr(module, n)]
        assert not missing, f"{old} does not re-export {missing} of {new}"


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports at run time (also inside functions; not under
    `if TYPE_CHECKING:`): `from package import module` names the module, `from module import name` the
    module."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                for alias in node.names
            }
    return found & known


def test_no_import_cycle():
    """No module imports, even inside a function, one that imports it back (through any chain)."""
    paths = {module_name(p): p for p in SOURCES}
    graph = {module: imported_modules(path, set(paths)) - {module} for module, path in paths.items()}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            assert module != start, f"{start} imports itself back through {sorted(seen)}"
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
