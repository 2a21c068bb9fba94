"""The four top-level folders install as the `mortal` namespace, editable and as a built wheel."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {
    "mortal": "mortal",
    "mortal.specs": "specs",
    "mortal.state": "state",
    "mortal.controller": "controller",
    "mortal.workers": "workers",
}


def declared_packages() -> list[str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def folder_packages() -> set[str]:
    """Every folder with an __init__.py under the mapped roots, as its dotted `mortal.*` name."""
    found = set()
    for package, folder in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *rel)))
    return found


IMPORT_ALL = "import importlib, sys; [print(importlib.import_module(n).__file__) for n in sys.argv[1:]]"


def import_everything(python: str, env: dict | None, cwd: Path) -> list[str]:
    out = subprocess.run(
        [python, "-c", IMPORT_ALL, *declared_packages()],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_every_package_folder_is_declared_in_pyproject():
    assert folder_packages() == set(declared_packages())


def test_editable_install_imports_every_subpackage_from_the_repo(tmp_path):
    files = import_everything(sys.executable, None, tmp_path)
    assert all(f.startswith(str(REPO)) for f in files), files
    assert any("/state/" in f for f in files) and any("/specs/" in f for f in files)


@pytest.mark.slow
def test_built_wheel_imports_every_subpackage(tmp_path):
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    # data folders are declared as package data, not left for setuptools to guess (and warn about)
    assert "Package would be ignored" not in build.stdout + build.stderr
    wheel = next(tmp_path.glob("mortal-*.whl"))
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    # PYTHONPATH comes before the editable finder: the wheel's copy must be the one imported.
    files = import_everything(sys.executable, {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, tmp_path)
    assert all(f.startswith(str(target)) for f in files), files
    assert (target / "mortal" / "specs" / "examples" / "quickstart.yaml").exists()
    assert (target / "mortal" / "state" / "migrations").is_dir()
    assert (target / "mortal" / "client" / "cli" / "dashboard_static" / "dashboard.js").exists()
    assert next((target / "mortal" / "workers" / "builtin_data").glob("*.jsonl"), None) is not None
