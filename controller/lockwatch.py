"""Free a SQLite store from a worker frozen while it held the write lock.

A worker stopped (SIGSTOP, a debugger) inside a SQLite write transaction keeps the one write lock, and
every writer waits behind it, the controller's leader-lease renewal included, so the hung worker would
never be judged lost. PostgreSQL ends such a session itself; SQLite has no server to. So the controller
finds the holder in /proc/locks (in WAL mode it locks a byte of the `-shm` file) and kills it, with its
process group, once it has been stopped for `grace_seconds`; the next reconcile judges its row lost.
Linux only. Only stopped workers of this MORTAL_HOME are killed, never a running writer or another process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import psutil

log = logging.getLogger("mortal.controller")
WAL_WRITE_LOCK_OFFSET = 120  # SQLite's WAL_WRITE_LOCK byte in the shared-memory file
PROC_LOCKS = Path("/proc/locks")


def write_lock_holders(database: Path, locks: Path = PROC_LOCKS) -> set[int]:
    """Pids holding the WAL write lock of `database` (empty if none, or where /proc/locks is missing)."""
    try:
        inode = os.stat(f"{database}-shm").st_ino
        lines = locks.read_text().splitlines()
    except OSError:
        return set()
    holders = set()
    for line in lines:
        fields = line.split()
        if "->" in fields:  # a waiter, listed under the lock it waits for
            continue
        # "1: POSIX  ADVISORY  WRITE 11511 fe:00:2146335 120 120"
        if (
            len(fields) >= 8
            and fields[3] == "WRITE"
            and fields[5].rsplit(":", 1)[-1] == str(inode)
            and fields[6] == str(WAL_WRITE_LOCK_OFFSET)
        ):
            holders.add(int(fields[4]))
    return holders


def _stopped_worker(pid: int, home: str) -> bool:
    try:
        proc = psutil.Process(pid)
        env = proc.environ()
        return (
            proc.status() == psutil.STATUS_STOPPED
            and "MORTAL_WORKER_ID" in env
            and os.path.realpath(env.get("MORTAL_HOME", "")) == os.path.realpath(home)
        )
    except psutil.Error:
        return False


class FrozenLockHolderWatch:
    """Checks every `period_seconds`; kills a stopped worker that held the lock for `grace_seconds`."""

    def __init__(self, database: Path, home: str, grace_seconds: float, period_seconds: float = 1.0) -> None:
        self.database, self.home = database, home
        self.grace, self.period = grace_seconds, period_seconds
        self._stopped_since: dict[int, float] = {}

    def check(self, now: float | None = None) -> list[int]:
        """One look; returns the pids it killed."""
        now = time.monotonic() if now is None else now
        frozen = {pid for pid in write_lock_holders(self.database) if _stopped_worker(pid, self.home)}
        self._stopped_since = {pid: self._stopped_since.get(pid, now) for pid in frozen}
        killed = [pid for pid, since in self._stopped_since.items() if now - since >= self.grace]
        for pid in killed:
            log.warning(
                "worker pid %d is stopped holding the write lock of %s: killing it", pid, self.database
            )
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
        return killed

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.period):
            try:
                self.check()
            except Exception:  # a watchdog must outlive a bad read of /proc
                log.exception("lock watch failed")
