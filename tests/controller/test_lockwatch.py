"""A worker stopped inside a SQLite write transaction is found through /proc/locks and killed; nothing
else that holds the lock is touched."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from polling import wait_for

from mortal.controller.lockwatch import FrozenLockHolderWatch, write_lock_holders

pytestmark = pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux's /proc/locks")

HOLDER = """
import os, signal, sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO t VALUES (1)")
print("locked", flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(600)
"""


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (x)")
    db.close()
    return path


def hold_lock(database: Path, home: Path, stop: bool, worker: bool = True) -> subprocess.Popen[str]:
    env = {**os.environ, "MORTAL_HOME": str(home)}
    if worker:
        env["MORTAL_WORKER_ID"] = "r/rollout-0#1"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(database), "stop" if stop else "run"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    if stop:
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED, 10, "the holder to stop")
    return proc


def can_write(database: Path) -> bool:
    db = sqlite3.connect(database, isolation_level=None, timeout=0.2)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()


def test_a_worker_stopped_holding_the_write_lock_is_killed_after_the_grace(
    database: Path, tmp_path: Path
) -> None:
    proc = hold_lock(database, tmp_path, stop=True)
    try:
        assert write_lock_holders(database) == {proc.pid}
        assert not can_write(database), "the frozen worker blocks every writer"
        watch = FrozenLockHolderWatch(database, str(tmp_path), grace_seconds=5)
        assert watch.check(now=100.0) == []
        assert watch.check(now=104.0) == [], "stopped for less than the grace: left alone"
        assert watch.check(now=105.0) == [proc.pid]
        assert proc.wait(timeout=10) == -signal.SIGKILL
        wait_for(lambda: can_write(database), 10, "the write lock to be free")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize(
    ("stop", "worker"), [(False, True), (True, False)], ids=["running-worker", "not-a-worker"]
)
def test_a_running_holder_or_a_process_that_is_not_a_worker_is_left_alone(
    database: Path, tmp_path: Path, stop: bool, worker: bool
) -> None:
    proc = hold_lock(database, tmp_path, stop=stop, worker=worker)
    try:
        assert write_lock_holders(database) == {proc.pid}
        watch = FrozenLockHolderWatch(database, str(tmp_path), grace_seconds=0)
        assert watch.check(now=1.0) == [] and watch.check(now=1000.0) == []
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_no_database_or_no_lock_holds_nothing(database: Path, tmp_path: Path) -> None:
    assert write_lock_holders(tmp_path / "missing.db") == set()
    assert write_lock_holders(database) == set()
    started = time.monotonic()
    assert FrozenLockHolderWatch(database, str(tmp_path), grace_seconds=0).check() == []
    assert time.monotonic() - started < 1.0


def test_a_controller_on_sqlite_runs_the_watch_and_one_on_another_store_does_not(mortal_home: Path) -> None:
    from realproc import FAST

    from mortal.controller.manager import Controller
    from mortal.state import open_store

    for url, watched in ((f"sqlite:///{mortal_home / 'state.db'}", True), ("sqlite://", False)):
        store = open_store(url)
        controller = Controller(store, url, FAST).start()
        try:
            assert ("mortal-lock-watch" in {t.name for t in controller._threads}) is watched
        finally:
            controller.stop()
            store.close()
