"""The wake channel: writers of desired state (the CLI) tell a controller on this machine to look now.

`notify(run)` touches a file under $MORTAL_HOME/wake/; the manager watches that folder (watchfiles)
and compares run versions at once instead of at its next poll. Best effort by design: a controller
elsewhere (PostgreSQL shared between machines) still sees the change at its next poll.
What it must not do: carry data. The store is the only truth; a wake says only "look".
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from mortal.state import paths

ALL = "all"


def wake_dir() -> Path:
    return paths.mortal_home() / "wake"


def notify(run: str | None = None) -> None:
    """Ask controllers of this MORTAL_HOME to reconcile `run` (or every run that changed) now."""
    folder = wake_dir()
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / (run or ALL)
        with open(target, "a"):
            os.utime(target)
