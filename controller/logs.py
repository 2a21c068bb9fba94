"""Worker logs on this machine: which files belong to a run, and their lines (for `mortalctl logs`).

Called by the CLI: `mortalctl logs NAME [--role R] [--replica I] [--tail N] [-f]`. Files are
mortal.state.paths.worker_log: `<role>-<replica>-<incarnation>.log` under the run's logs folder.
By default each slot shows its newest incarnation; `-f` keeps reading, and moves to a slot's new
file when the worker is relaunched. What it must not do: open the store or touch the files.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mortal.state import paths

_LOG_NAME = re.compile(r"^(?P<role>[a-z]+)-(?P<replica>\d+)-(?P<incarnation>\d+)\.log$")
_ROLE_ORDER = {"actor": 0, "rollout": 1}


@dataclass(frozen=True)
class LogFile:
    path: Path
    role: str
    replica: int
    incarnation: int

    @property
    def slot(self) -> str:
        return f"{self.role}-{self.replica}"


def worker_logs(run: str, role: str | None = None, replica: int | None = None, all_incarnations: bool = False) -> list[LogFile]:
    """The run's log files matching role/replica, newest incarnation per slot unless all_incarnations."""
    folder = paths.logs_dir(run)
    found: list[LogFile] = []
    if folder.is_dir():
        for path in folder.iterdir():
            m = _LOG_NAME.match(path.name)
            if m is None:
                continue
            log = LogFile(path, m["role"], int(m["replica"]), int(m["incarnation"]))
            if (role is None or log.role == role) and (replica is None or log.replica == replica):
                found.append(log)
    if not all_incarnations:
        newest: dict[str, LogFile] = {}
        for log in found:
            if log.slot not in newest or log.incarnation > newest[log.slot].incarnation:
                newest[log.slot] = log
        found = list(newest.values())
    return sorted(found, key=_order)


def _order(log: LogFile) -> tuple[int, str, int, int]:
    return _ROLE_ORDER.get(log.role, 9), log.role, log.replica, log.incarnation


def log_files(run: str, role: str | None = None, replica: int | None = None) -> list[Path]:
    """Paths of the newest log file of each matching slot."""
    return [f.path for f in worker_logs(run, role, replica)]


def read_logs(
    run: str,
    role: str | None = None,
    replica: int | None = None,
    follow: bool = False,
    tail: int | None = None,
    poll_seconds: float = 0.5,
    stop: threading.Event | None = None,
) -> Iterator[str]:
    """Lines (without newline) of the matching logs, `[slot] ` in front when several slots match.

    `tail` keeps the last N lines of each file. `follow` then keeps yielding lines as they are
    written (and from new incarnations' files) until `stop` is set or the caller stops iterating.
    """
    files = worker_logs(run, role, replica)
    prefixed = len(files) > 1
    offsets: dict[Path, int] = {}
    for log in files:
        start = 0 if tail is None else _tail_offset(log.path, tail, partial=not follow)
        text, offsets[log.path] = _read_from(log.path, start, partial=not follow)
        for line in text.splitlines():
            yield _prefix(log, line, prefixed)
    tracked = {log.path: log for log in files}
    while follow and not (stop is not None and stop.is_set()):
        time.sleep(poll_seconds)
        current = worker_logs(run, role, replica)
        prefixed = prefixed or len(current) > 1
        tracked.update((log.path, log) for log in current)  # an old incarnation's last lines still come
        for log in sorted(tracked.values(), key=_order):
            text, offsets[log.path] = _read_from(log.path, offsets.get(log.path, 0))
            for line in text.splitlines():
                yield _prefix(log, line, prefixed)


def _read_from(path: Path, offset: int, partial: bool = False) -> tuple[str, int]:
    """Lines written after `offset`, and the offset after them; a half-written last line waits
    unless `partial` (a log read once, whose writer may have died mid-line)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return "", offset
    end = len(data) if partial else data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace"), offset + end


def _tail_offset(path: Path, n: int, partial: bool = False, block: int = 65536) -> int:
    """Offset where the last `n` lines begin (reads backwards, so a huge log costs little); a
    half-written last line counts as one only with `partial`."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if n <= 0 and partial:
                return size
            while True:
                start = max(0, size - block)
                fh.seek(start)
                data = fh.read(size - start)
                pos = data.rfind(b"\n")  # end of the last complete line
                count = n - 1 if partial and data and not data.endswith(b"\n") else n
                for _ in range(count):
                    if pos < 0:
                        break
                    pos = data.rfind(b"\n", 0, pos)
                if pos >= 0:
                    return start + pos + 1
                if start == 0:
                    return 0
                block *= 4
    except FileNotFoundError:
        return 0


def _prefix(log: LogFile, line: str, prefixed: bool) -> str:
    return f"[{log.slot}] {line}" if prefixed else line
