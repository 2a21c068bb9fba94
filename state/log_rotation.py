"""A worker log's size cap: past its limit the log's content moves to `<log>.1` and the log starts over.

Who calls it: mortal.workers.main (LogCap, a thread watching the file its stdout and stderr append to, as
the local and Ray backends open it) and mortal.controller.backends.modal_worker's tee (which writes the
file itself). Why: a reward or tool that prints for every sample, or a warning raised every step, grew the
log without bound until the disk filled; kubelet caps container logs the same way.
Why not logging's RotatingFileHandler: it rotates only what `logging` writes, not print() from the run's
code, a C library's writes or a child process's, which all land on the inherited descriptor; and it
renames the file, which that descriptor would go on writing to.
How: copy, then truncate (logrotate's copytruncate). The descriptor was opened for appending, so after the
truncate every writer's next write lands at the new start. What is written between the copy and the
truncate is lost: the window is one copy of the file.
What it must not do: rotate a descriptor that is not appending (its next write would leave a hole of zeros
where the old content was), or fail the worker (an error is logged once and the cap stops).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import TypeVar

log = logging.getLogger("mortal.worker")

MAX_BYTES_ENV = "MORTAL_WORKER_LOG_MAX_BYTES"  # a worker's environment may set its own cap ("0": none)
DEFAULT_MAX_BYTES = 10 * 1024 * 1024  # kubelet's default containerLogMaxSize
CHECK_SECONDS = 2.0


def _given(environ: Mapping[str, str]) -> tuple[str, int | None]:
    """MAX_BYTES_ENV as set, and its count of bytes (None unless ASCII digits: not "10Mi", "-5" or "²")."""
    value = environ.get(MAX_BYTES_ENV, "").strip()
    return value, int(value) if value.isascii() and value.isdigit() else None


def max_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The cap in bytes from MAX_BYTES_ENV (0: no cap), DEFAULT_MAX_BYTES when unset or not a count of bytes
    (said once in the worker's log: LogCap.start)."""
    _, count = _given(environ)
    return DEFAULT_MAX_BYTES if count is None else count


LogPath = TypeVar("LogPath", bound=PurePath)  # a file here, or one on a volume or in storage


def rotated_path(log_path: LogPath) -> LogPath:
    """Where the content before the last rotation is: `<log>.1` (mortalctl logs reads it before `<log>`)."""
    return log_path.with_name(log_path.name + ".1")


def rotation_stamp(log_path: Path) -> tuple[int, int] | None:
    """What changes each time `log_path` is rotated on this machine (rotate replaces `<log>.1`: a new inode
    and time); None while it never was."""
    try:
        rotated = rotated_path(log_path).stat()
    except FileNotFoundError:
        return None
    return rotated.st_ino, rotated.st_mtime_ns


def rotate(fd: int, log_path: Path) -> None:
    """Copy the file `fd` appends to (named `log_path`), truncate it, then put the copy in rotated_path's
    place. In that order a reader (mortal.controller.logs) that sees a new rotated file also sees the log
    already emptied, so it never reads the old content twice."""
    target = rotated_path(log_path)
    partial = target.with_name(target.name + ".partial")
    with contextlib.suppress(FileNotFoundError):  # a link planted there is replaced, never followed
        partial.unlink()
    with open(log_path, "rb") as source, open_new_file(partial) as copy:
        shutil.copyfileobj(source, copy)
    os.ftruncate(fd, 0)
    os.replace(partial, target)


def open_new_file(path: Path) -> io.BufferedWriter:
    """`path` created for writing, its owner's alone as the log it copies is, refused (FileExistsError) when
    anything is there, a symlink included: what a worker's code planted in its run's folder is never written
    through."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")


def appended_file(fd: int) -> Path | None:
    """The regular file `fd` appends to, or None: a pipe or a terminal, a descriptor not opened for
    appending, or a system without /proc (nothing to rotate safely there)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        return path if os.stat(path).st_ino == info.st_ino else None
    except OSError:
        return None


class LogCap:
    """Keeps the file descriptor `fd` appends to under `limit` bytes, looking every `every` seconds."""

    def __init__(self, fd: int = 1, limit: int | None = None, every: float = CHECK_SECONDS) -> None:
        self._fd, self._limit, self._every = fd, max_bytes() if limit is None else limit, every

    def start(self) -> bool:
        """Start watching (a daemon thread: it ends with the process); False (nothing started) when there is
        no cap or nothing to rotate."""
        given, count = _given(os.environ)
        if given and count is None:
            log.warning(
                "%s=%r is not a count of bytes: the log's cap is %d bytes", MAX_BYTES_ENV, given, self._limit
            )
        path = appended_file(self._fd)
        if not self._limit or path is None:
            return False
        threading.Thread(target=self._watch, args=(path,), name="mortal-log-cap", daemon=True).start()
        return True

    def _watch(self, path: Path) -> None:
        while True:
            time.sleep(self._every)
            try:
                if os.fstat(self._fd).st_size > self._limit:
                    rotate(self._fd, path)
            except OSError as exc:
                log.warning("the log's size cap stops: %s could not be rotated: %s", path, exc)
                return
