"""Errors the controller layer raises to the client that started or asked it something.

Raised by mortal.controller.manager; mortalctl prints them as one paragraph and exits 1
(mortal/client/cli/error_messages.py), MortalTrainer lets them through to its caller.
"""

from __future__ import annotations

import signal
from pathlib import Path


class ControllerStartFailed(Exception):
    """A background controller exited before it finished starting, so nothing reconciles what was applied.

    `status` is its exit status (negative: the signal that ended it), `log` its log file and `tail` the
    last lines that start wrote there (untrusted text: a terminal must be shown it through `plain`).
    """

    def __init__(self, pid: int, status: int, log: Path, tail: list[str]) -> None:
        self.pid, self.status, self.log, self.tail = pid, status, log, tail
        shown = "\n".join(f"  {line}" for line in tail) if tail else "  (it wrote nothing)"
        super().__init__(
            f"the background controller (pid {pid}) {_ended(status)} while starting; "
            f"the end of its log {log}:\n{shown}"
        )


def _ended(status: int) -> str:
    if status >= 0:
        return f"exited with status {status}"
    try:
        return f"was killed by {signal.Signals(-status).name}"
    except ValueError:
        return f"was killed by signal {-status}"
