"""The HTTP store's access log: one JSON line per request, who asked for what and what it was answered.

    {"time": "...Z", "who": "admin" | "worker:run/role-replica#incarnation" | "unknown", "call": "lease_task",
     "run": "quickstart" | null, "status": 200, "client": "127.0.0.1"}

Written by mortal.state.http_server to $MORTAL_HOME/access.log (the server's home; on Modal the state
volume), created private (0600). Tokens never reach it: the server passes identities, not credentials;
what the client named (a call, a run) is JSON-escaped, so a reader prints text, never control sequences.
Rotate it with logrotate as any log: the handler reopens the file when it was moved away.
What it must not do: fail a request (a full disk loses log lines, not calls).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from io import TextIOWrapper
from logging.handlers import WatchedFileHandler
from pathlib import Path

MAX_FIELD_CHARS = 200  # a client-chosen name (an unknown path, a run) is cut to this in the log


class _PrivateFileHandler(WatchedFileHandler):
    """WatchedFileHandler that creates its file 0600 (the stdlib one takes the umask's mode)."""

    def _open(self) -> TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return open(fd, "a", encoding="utf-8")  # noqa: SIM115 - the handler owns and closes the stream


class AccessLog:
    """Appends access records to `path` (its folder created); thread-safe (the handler's lock)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = _PrivateFileHandler(self.path, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def record(self, who: str, call: str, run: str | None, status: int, client: str | None) -> None:
        line = json.dumps(
            {
                "time": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
                "who": who,
                "call": _cut(call),
                "run": None if run is None else _cut(run),
                "status": status,
                "client": client,
            }
        )
        self._handler.handle(
            logging.makeLogRecord({"msg": line, "levelno": logging.INFO, "levelname": "INFO"})
        )

    def close(self) -> None:
        self._handler.close()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_FIELD_CHARS else text[:MAX_FIELD_CHARS] + "..."
