"""The README's commands, as a reader copies them: none of them overwrites a file the repository tracks."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WRITES = re.compile(r"--(?:screenshot|output|out)[= ](\S+)")


def tracked_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return set(listed.stdout.split())


def test_readme_commands_write_no_tracked_file():
    written = WRITES.findall((REPO / "README.md").read_text())
    assert written, "the README's screenshot command is no longer found: update this test"
    tracked = tracked_files()
    overwritten = [path for path in written if not path.startswith("/") and path.removeprefix("./") in tracked]
    assert overwritten == [], f"README commands overwrite tracked files: {overwritten}"


def load_script(name: str):
    """A script of scripts/ as a module (scripts/ is not a package: its files are run, not imported)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_spec_reference_is_the_one_the_schema_generates():
    generated = load_script("spec_reference").render()
    checked_in = (REPO / "docs" / "spec-reference.md").read_text()
    assert checked_in == generated, (
        "docs/spec-reference.md is out of date with the spec's field descriptions: "
        "regenerate it with `python scripts/spec_reference.py --write`"
    )
