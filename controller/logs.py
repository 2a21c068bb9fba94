"""Worker logs: which files belong to a run, and their lines (for `mortalctl logs`).

Called by the CLI: `mortalctl logs NAME [--role R] [--replica I] [--tail N] [-f]`. Files are
mortal.state.paths.worker_log, read from where the run's workers write them: this machine's MORTAL_HOME
(`LocalLogs`), the Modal data volume (`VolumeLogs`), or for a Ray run whose nodes share no filesystem
the run's storage (`StorageLogs`, where each worker's log is uploaded). By default each slot shows its
newest incarnation; `-f` keeps reading, and moves to a slot's new file when the worker is relaunched.
What it must not do: open the store or touch the files.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol

from mortal.state import log_rotation, paths

_LOG_NAME = re.compile(r"^(?P<role>[a-z]+)-(?P<replica>\d+)-(?P<incarnation>\d+)\.log$")
_ROLE_ORDER = {"actor": 0, "rollout": 1}
VOLUME_POLL_SECONDS = 2.0  # `-f` on a Modal run: each poll lists the folder on the volume


@dataclass(frozen=True)
class LogFile:
    path: PurePosixPath | Path  # on this machine (LocalLogs), or inside the volume (VolumeLogs)
    role: str
    replica: int
    incarnation: int

    @property
    def slot(self) -> str:
        return f"{self.role}-{self.replica}"


class LogSource(Protocol):
    """Where a run's log files are: their names, and their bytes from an offset."""

    def names(self, run: str) -> list[PurePosixPath | Path]:
        """The files of the run's logs folder (none when it does not exist)."""

    def read(self, path: PurePosixPath | Path, offset: int) -> bytes:
        """The file's bytes from `offset` (none when it does not exist)."""

    def tail_offset(self, path: PurePosixPath | Path, n: int, partial: bool) -> int:
        """Where the file's last `n` lines begin (see _tail_start)."""

    def rotation(self, path: PurePosixPath | Path) -> object:
        """What changes each time the file is rotated (state/log_rotation.py replaces <log>.1): None
        while it never was."""


class LocalLogs:
    """The log files under this machine's MORTAL_HOME (the local backend's workers write them)."""

    def names(self, run: str) -> list[PurePosixPath | Path]:
        """The regular files of the run's own logs folder: a link (to a file outside, to /dev/zero) or a
        logs folder that links out is not the run's log and is never read."""
        folder = paths.logs_dir(run)
        if folder.is_symlink() or not folder.is_dir():
            return []
        return [p for p in folder.iterdir() if not p.is_symlink() and p.is_file()]

    def read(self, path: PurePosixPath | Path, offset: int) -> bytes:
        fh = _open_own(path)
        if fh is None:
            return b""
        with fh:
            fh.seek(offset)
            return fh.read()

    def rotation(self, path: PurePosixPath | Path) -> object:
        return log_rotation.rotation_stamp(Path(path))

    def tail_offset(self, path: PurePosixPath | Path, n: int, partial: bool, block: int = 65536) -> int:
        """Reads backwards, a growing block at a time, so the tail of a huge log costs little."""
        fh = _open_own(path)
        if fh is None:
            return 0
        with fh:
            size = fh.seek(0, 2)
            while True:
                start = max(0, size - block)
                fh.seek(start)
                found = _tail_start(fh.read(size - start), n, partial)
                if found is not None:
                    return start + found
                if start == 0:
                    return 0
                block *= 4


def _open_own(path: PurePosixPath | Path) -> BinaryIO | None:
    """The log file opened for reading, never through a link: None when it is gone, or when a link was put
    in its place since it was listed (ELOOP from O_NOFOLLOW)."""
    try:
        return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise


class VolumeLogs:
    """The log files on a Modal volume (`runs/<run>/logs/`), read through the client library.

    `volume` is a modal.Volume (listdir, read_file); `missing` the errors that mean "no such path"
    (FileNotFoundError, and modal.exception.NotFoundError). A volume has no ranged read: a file is
    read whole, and only when its listed size grew past what was already read."""

    def __init__(self, volume: Any, missing: tuple[type[BaseException], ...] = (FileNotFoundError,)) -> None:
        self._volume, self._missing = volume, missing
        self._sizes: dict[str, int] = {}
        self._stamps: dict[str, object] = {}  # each listed file's size and time: a rotated file's changes

    def names(self, run: str) -> list[PurePosixPath | Path]:
        try:
            entries = self._volume.listdir(f"runs/{run}/logs")
        except self._missing:
            return []
        self._sizes.update((entry.path, entry.size) for entry in entries)
        self._stamps.update((entry.path, (entry.size, getattr(entry, "mtime", None))) for entry in entries)
        return [PurePosixPath(entry.path) for entry in entries]

    def read(self, path: PurePosixPath | Path, offset: int) -> bytes:
        if self._sizes.get(str(path), offset + 1) <= offset:
            return b""
        try:
            return b"".join(self._volume.read_file(str(path)))[offset:]
        except self._missing:
            return b""

    def tail_offset(self, path: PurePosixPath | Path, n: int, partial: bool) -> int:
        return _tail_start(self.read(path, 0), n, partial) or 0

    def rotation(self, path: PurePosixPath | Path) -> object:
        return self._stamps.get(str(log_rotation.rotated_path(path)))


LOG_UPLOAD_SECONDS = 5.0  # how often a Ray worker's actor uploads its log to the run's storage (StorageLogs)


def _modified(entry: dict[str, Any]) -> object:
    """A listed file's modification time, under the name its fsspec filesystem gives it."""
    return next(
        (entry[key] for key in ("mtime", "LastModified", "updated", "last_modified") if key in entry), None
    )


def storage_log_url(uri: str, run: str, name: str) -> str:
    """Where a worker's log file `name` (<role>-<replica>-<incarnation>.log) is kept in the run's storage."""
    return f"{uri.rstrip('/')}/{run}/logs/{name}"


class StorageLogs:
    """The log files in a run's storage (spec.checkpoint.uri, read with fsspec): a Ray run's whose nodes share
    no filesystem. Like a volume's, a file is read whole (object stores have ranged reads, but the files
    are small and replaced whole on each upload), and only when its listed size grew."""

    def __init__(self, uri: str) -> None:
        import fsspec

        self._uri = uri.rstrip("/")
        self._fs, self._root = fsspec.core.url_to_fs(self._uri)
        self._sizes: dict[str, int] = {}
        self._stamps: dict[str, object] = {}  # each listed file's size and time: a rotated file's changes

    def names(self, run: str) -> list[PurePosixPath | Path]:
        try:
            entries = self._fs.ls(f"{self._root}/{run}/logs", detail=True, refresh=True)
        except FileNotFoundError:
            return []
        self._sizes.update((entry["name"], entry.get("size") or 0) for entry in entries)
        self._stamps.update((entry["name"], (entry.get("size"), _modified(entry))) for entry in entries)
        return [PurePosixPath(entry["name"]) for entry in entries if entry.get("type") == "file"]

    def read(self, path: PurePosixPath | Path, offset: int) -> bytes:
        if self._sizes.get(str(path), offset + 1) <= offset:
            return b""
        try:
            return self._fs.cat_file(str(path))[offset:]
        except FileNotFoundError:
            return b""

    def tail_offset(self, path: PurePosixPath | Path, n: int, partial: bool) -> int:
        return _tail_start(self.read(path, 0), n, partial) or 0

    def rotation(self, path: PurePosixPath | Path) -> object:
        return self._stamps.get(str(log_rotation.rotated_path(path)))


def worker_logs(
    run: str,
    role: str | None = None,
    replica: int | None = None,
    all_incarnations: bool = False,
    source: LogSource | None = None,
) -> list[LogFile]:
    """The run's log files matching role/replica, newest incarnation per slot unless all_incarnations."""
    found: list[LogFile] = []
    for path in (source or LocalLogs()).names(run):
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
    """Paths of the newest log file of each matching slot (on this machine)."""
    return [Path(f.path) for f in worker_logs(run, role, replica)]


def read_logs(
    run: str,
    role: str | None = None,
    replica: int | None = None,
    follow: bool = False,
    tail: int | None = None,
    poll_seconds: float = 0.5,
    stop: threading.Event | None = None,
    source: LogSource | None = None,
) -> Iterator[str]:
    """Lines (without newline) of the matching logs, `[slot] ` in front when several slots match.

    `tail` keeps the last N lines of each file. `follow` then keeps yielding lines as they are
    written (and from new incarnations' files) until `stop` is set or the caller stops iterating.
    """
    source = source or LocalLogs()
    files = worker_logs(run, role, replica, source=source)
    prefixed = len(files) > 1
    offsets: dict[PurePosixPath | Path, int] = {}
    rotations = {log.path: source.rotation(log.path) for log in files}
    for log in files:
        start = 0 if tail is None else source.tail_offset(log.path, tail, partial=not follow)
        text, offsets[log.path] = _lines(source.read(log.path, start), start, partial=not follow)
        lines = _split_lines(text)
        older = _rotated_lines(source, log.path, last=None if tail is None else tail - len(lines))
        for line in older + lines:
            yield _prefix(log, line, prefixed)
    tracked = {log.path: log for log in files}
    while follow and not (stop is not None and stop.is_set()):
        time.sleep(poll_seconds)
        current = worker_logs(run, role, replica, source=source)
        prefixed = prefixed or len(current) > 1
        tracked.update((log.path, log) for log in current)  # an old incarnation's last lines still come
        for log in sorted(tracked.values(), key=_order):
            offset = offsets.get(log.path, 0)
            rotation = source.rotation(log.path)
            if rotation != rotations.setdefault(log.path, rotation):  # what was not read yet is in <log>.1
                rotations[log.path] = rotation
                for line in _rotated_lines(source, log.path, after=offset):
                    yield _prefix(log, line, prefixed)
                offset = 0
            text, offsets[log.path] = _lines(source.read(log.path, offset), offset)
            for line in _split_lines(text):
                yield _prefix(log, line, prefixed)


def _rotated_lines(
    source: LogSource, path: PurePosixPath | Path, after: int = 0, last: int | None = None
) -> list[str]:
    """The lines of what the log held before its last rotation (<log>.1), from byte `after`, or its `last`
    lines: they come before the log's own (a log just rotated still shows its tail)."""
    if last is not None and last <= 0:
        return []
    rotated = log_rotation.rotated_path(path)
    start = after if last is None else source.tail_offset(rotated, last, partial=True)
    text, _ = _lines(source.read(rotated, start), start, partial=True)
    return _split_lines(text)


def _split_lines(text: str) -> list[str]:
    """Lines as the log's writer ended them, at newlines only (str.splitlines also splits at a carriage
    return, a form feed and Unicode separators, so a progress bar's \r updates became lines of their own
    and the tail count drifted from the byte offsets, which count newlines). A CRLF's CR is dropped."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _lines(data: bytes, offset: int, partial: bool = False) -> tuple[str, int]:
    """The lines of `data` (read at `offset`), and the offset after them; a half-written last line
    waits unless `partial` (a log read once, whose writer may have died mid-line)."""
    end = len(data) if partial else data.rfind(b"\n") + 1
    return data[:end].decode("utf-8", errors="replace"), offset + end


def _tail_start(data: bytes, n: int, partial: bool) -> int | None:
    """Where the last `n` lines of `data` begin; None when it holds fewer (read further back). A
    half-written last line counts as one only with `partial`."""
    if n <= 0 and partial:
        return len(data)
    pos = data.rfind(b"\n")  # end of the last complete line
    count = n - 1 if partial and data and not data.endswith(b"\n") else n
    for _ in range(count):
        if pos < 0:
            break
        pos = data.rfind(b"\n", 0, pos)
    return pos + 1 if pos >= 0 else None


def _prefix(log: LogFile, line: str, prefixed: bool) -> str:
    return f"[{log.slot}] {line}" if prefixed else line
