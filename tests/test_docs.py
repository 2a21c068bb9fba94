"""The README's commands, as a reader copies them: none of them overwrites a file the repository tracks."""

from __future__ import annotations

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
