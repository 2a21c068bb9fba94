"""A layer imports only the layers below it: specs < state < controller, workers < client (CLI, MortalTrainer).

Checked on the source (every `import` / `from ... import`, also inside functions), as kopf's
import-linter contracts do, so a shortcut across layers fails here before it spreads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {"specs": "mortal.specs", "state": "mortal.state", "controller": "mortal.controller", "workers": "mortal.workers"}
# modal_app is the Modal deployment's composition root: its functions wrap controller and worker code alike.
CLIENT = ("mortal.controller.cli", "mortal.controller.trainer", "mortal.controller.trainer_inputs", "mortal.controller.modes",
          "mortal.controller.modal_app")

ALLOWED = {
    "mortal.specs": {"mortal.specs"},
    "mortal.state": {"mortal.specs", "mortal.state"},
    "mortal.workers": {"mortal.specs", "mortal.state", "mortal.workers"},
    "mortal.controller": {"mortal.specs", "mortal.state", "mortal.controller"},
}


def module_name(path: Path) -> str:
    folder, *rest = path.relative_to(REPO).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    if module.startswith(CLIENT):
        return "client"
    return ".".join(module.split(".")[:2])


def mortal_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.startswith("mortal.")}


SOURCES = sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_imports_only_lower_layers(path):
    own = layer(module_name(path))
    if own == "client":
        return
    wrong = {name for name in mortal_imports(path) if layer(name) not in ALLOWED[own]}
    assert not wrong, f"{module_name(path)} ({own}) must not import {sorted(wrong)}"


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (also inside functions): `from package import module`
    names the module, `from module import name` the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                      for alias in node.names}
    return found & known


def test_workers_import_no_cycle():
    """No module of workers/ imports, even inside a function, one that imports it back (through any chain)."""
    paths = {module_name(p): p for p in SOURCES if p.relative_to(REPO).parts[0] == "workers"}
    graph = {module: imported_modules(path, set(paths)) - {module} for module, path in paths.items()}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            assert module != start, f"{start} imports itself back through {sorted(seen)}"
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
