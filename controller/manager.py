"""The controller process: leader election, wake-ups, the work queue and its reconcile threads.

Who calls it: `mortalctl controller` and `python -m mortal.controller` (`run_controller`, in the
foreground), `mortalctl apply` (`ensure_background_controller`: starts one detached when none runs and
waits until it says, through a pipe, that it started), tests (`Controller` in a thread). Wake-ups, so a
change is acted on at once and failures within seconds: the wake folder (the CLI's `wake.notify`) and a
poll of run resource versions every `poll_seconds` enqueue runs that changed; a run with live workers
asks to be looked at again every `plan.active_resync_seconds`; every run is resynced every
`resync_seconds`. Stopping a controller (SIGTERM, SIGINT) leaves workers running: the next controller
adopts them.
What it must not do: reconcile itself (the Reconciler does) or block a reconcile thread on a timer.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

import psutil
import watchfiles

from mortal.controller import failpoints, wake
from mortal.controller.backends import Backend, select_backend
from mortal.controller.errors import ControllerStartFailed
from mortal.controller.leader import LEASE_NAME, LeaderElector, holder_gone_here
from mortal.controller.lockwatch import FrozenLockHolderWatch
from mortal.controller.outcome import Retry
from mortal.controller.reconciler import ControllerConfig, Reconciler
from mortal.controller.watchdir import watch_folder
from mortal.controller.workqueue import WorkQueue, dispatch
from mortal.state import open_store, paths
from mortal.state.engine import sqlite_path
from mortal.state.store import Store

log = logging.getLogger("mortal.controller")
IDLE_PHASES = frozenset({"Succeeded", "Failed", "Suspended"})


class Controller:
    """One controller's threads over one store; `start()`, then `stop()` (workers keep running)."""

    def __init__(
        self,
        store: Store,
        state_url: str,
        config: ControllerConfig | None = None,
        watch: Path | None = None,
        backends: Callable[[str], Backend] = select_backend,
        holder: str | None = None,
        idle_exit_seconds: float | None = None,
    ):
        self.store, self.config, self.watch = store, config or ControllerConfig(), watch
        self.stopped = threading.Event()
        self.queue = WorkQueue(self.config.retry_base_seconds, self.config.retry_max_seconds)
        self.leader = LeaderElector(
            store,
            holder,
            self.config.leader_lease_seconds,
            self.config.leader_renew_seconds,
            on_started_leading=self._enqueue_all,
        )
        self.reconciler = Reconciler(store, state_url, self.leader, self.config, backends)
        self.state_url = state_url
        self.idle_exit_seconds = idle_exit_seconds
        self._versions: dict[str, int] = {}
        self._poke = threading.Event()
        self._leader_stop = threading.Event()  # set only once no reconcile is in flight
        self._threads: list[threading.Thread] = []
        self._last_resync = 0.0
        self._busy_since = time.monotonic()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> Controller:
        self._spawn("leader", self.leader.run, self._leader_stop)
        for i in range(self.config.threads):
            self._spawn(f"reconcile-{i}", self._work)
        self._spawn("poll", self._poll_loop)
        self._spawn("wake", self._watch_wake)
        if self.watch is not None:
            self._spawn(
                "watch-dir", watch_folder, self.store, self.watch, self.stopped, lambda _: self._poke.set()
            )
        database = sqlite_path(self.state_url)
        if database is not None:
            lock_watch = FrozenLockHolderWatch(
                database, str(paths.mortal_home()), self.config.worker_lease_seconds
            )
            self._spawn("lock-watch", lock_watch.run, self.stopped)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop reconciling and give the lease up; running workers are left for the next controller."""
        self.stopped.set()
        self.queue.shutdown()
        self._poke.set()
        deadline = time.monotonic() + timeout
        leader, *others = self._threads
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._leader_stop.set()  # passes are over: now the lease can go to the next controller
        leader.join(max(0.0, deadline - time.monotonic()))

    def _spawn(self, name: str, target: Callable[..., object], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"mortal-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- reconcile threads ----------------------------------------------------------------------------
    def _work(self) -> None:
        while (key := self.queue.get()) is not None:
            try:
                outcome = self.reconciler.reconcile(key)
            except Exception as exc:  # any error of a pass: a retry with backoff, logged with its trace
                log.exception("reconcile %s raised", key)
                outcome = Retry(f"{type(exc).__name__}: {exc}")
            try:
                dispatch(self.queue, key, outcome)
            finally:
                self.queue.done(key)

    # -- wake-ups ---------------------------------------------------------------------------------------
    def _enqueue_all(self) -> None:
        """Just became the leader: forget what we knew, look at every run."""
        self._versions.clear()
        self._last_resync = 0.0
        self._poke.set()

    def _poll_loop(self) -> None:
        while not self.stopped.is_set():
            self._poke.wait(self.config.poll_seconds)
            self._poke.clear()
            if self.stopped.is_set():
                return
            try:
                self.poll()
            except Exception as exc:  # the store is unreachable for a moment: poll again next tick
                log.warning("poll failed: %s", exc)

    def poll(self) -> None:
        """Enqueue runs whose resource version moved (not by our own status write); resync all at times."""
        rows = self.store.list_runs()
        self._check_idle(rows)
        if not self.leader.is_leader:
            return
        resync = time.monotonic() - self._last_resync >= self.config.resync_seconds
        names = {row.name for row in rows}
        for row in rows:
            seen = self._versions.get(row.name)
            mine = self.reconciler.written.get(row.name)
            if row.resource_version != seen and row.resource_version != mine:
                self.queue.add(row.name, urgent=seen is not None or not resync)
            elif resync:
                self.queue.add(row.name)
            self._versions[row.name] = row.resource_version
        for gone in set(self._versions) - names:
            self._versions.pop(gone, None)
            self.queue.add(gone, urgent=True)  # deleted under us: a pass sweeps any process left
        if resync:
            self._last_resync = time.monotonic()
            for name in self._orphan_runs(names):
                self.queue.add(name)

    def _orphan_runs(self, names: set[str]) -> set[str]:
        """Runs that have live processes but no row any more (a purge raced a launch)."""
        backend, _ = self.reconciler.backend("local")
        if backend is None:
            return set()
        return {w.run for w in backend.list() if w.alive and w.run not in names}

    def _check_idle(self, rows: list) -> None:
        """A background controller exits once nothing has needed it for `idle_exit_seconds`."""
        if self.idle_exit_seconds is None:
            return
        busy = any(r.phase not in IDLE_PHASES or r.deleted_at is not None for r in rows) or bool(
            self.store.list_workers(live_only=True)
        )
        if busy:
            self._busy_since = time.monotonic()
        elif time.monotonic() - self._busy_since >= self.idle_exit_seconds:
            log.info("idle for %.0fs: exiting", self.idle_exit_seconds)
            self.stopped.set()

    def _watch_wake(self) -> None:
        folder = wake.wake_dir()
        with contextlib.suppress(OSError):
            folder.mkdir(parents=True, exist_ok=True)
        try:
            for changes in watchfiles.watch(
                folder, stop_event=self.stopped, step=20, debounce=200, recursive=False, raise_interrupt=False
            ):
                for _, path in changes:
                    name = Path(path).name
                    if name != wake.ALL:
                        self.queue.add(name, urgent=True)
                self._poke.set()
        except (OSError, RuntimeError) as exc:  # no inotify here: the poll still sees every change
            log.warning(
                "wake folder not watched (%s); changes are seen within %.1fs", exc, self.config.poll_seconds
            )


# -- processes ----------------------------------------------------------------------------------------
def pid_file() -> Path:
    return paths.mortal_home() / "controller.pid"


def log_file() -> Path:
    return paths.mortal_home() / "controller.log"


def running_controller_pid() -> int | None:
    """The pid in controller.pid if that process is alive and is the one that wrote it."""
    try:
        pid_text, _, created = pid_file().read_text().strip().partition(" ")
        proc = psutil.Process(int(pid_text))
        if created and abs(proc.create_time() - float(created)) > 0.5:
            return None
        return proc.pid if proc.status() != psutil.STATUS_ZOMBIE else None
    except (OSError, ValueError, psutil.Error):
        return None


@dataclass(frozen=True)
class RunningController:
    """This MORTAL_HOME's controller, as its pid file and process tell (`mortalctl controller status`)."""

    pid: int
    home: Path
    since: datetime
    folder: str | None  # the working folder it was started in (None: the process does not say)
    log: Path


def running_controller() -> RunningController | None:
    pid = running_controller_pid()
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        since = datetime.fromtimestamp(proc.create_time(), UTC)
    except psutil.Error:
        return None
    try:
        folder: str | None = proc.cwd()
    except psutil.Error:
        folder = None
    return RunningController(pid, paths.mortal_home(), since, folder, log_file())


def stop_controller(timeout: float = 30.0) -> tuple[int, bool] | None:
    """SIGTERM the controller of this MORTAL_HOME and wait up to `timeout`, then SIGKILL it; (pid, killed),
    or None when none runs. Its workers keep running either way: the next controller adopts them."""
    pid = running_controller_pid()
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout)
        return pid, False
    except psutil.NoSuchProcess:
        return pid, False
    except psutil.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(OSError):
            pid_file().unlink()  # it had no chance to remove its own
        return pid, True


def _write_pid_file(pid: int) -> None:
    pid_file().parent.mkdir(parents=True, exist_ok=True)
    pid_file().write_text(f"{pid} {psutil.Process(pid).create_time()}\n")


def _leader_elsewhere(store: Store) -> bool:
    """An unexpired leader lease held by a live controller (elsewhere, or here outside the pid file); a
    lease left by a controller of this host that died is none."""
    lease = store.get_lease(LEASE_NAME)
    if lease is None or holder_gone_here(lease.holder):
        return False
    expires = lease.expires_at if lease.expires_at.tzinfo else lease.expires_at.replace(tzinfo=UTC)
    return expires > datetime.now(UTC)


def controller_running(store: Store) -> bool:
    """Whether a controller runs for this store: this home's (its pid file), or one holding the lease."""
    return running_controller_pid() is not None or _leader_elsewhere(store)


READY_FD_ENV = "MORTAL_CONTROLLER_READY_FD"
"""Names the pipe a background controller writes one byte to once it has started (its store open, its
threads running); `ensure_background_controller` reads the other end. Unset, a controller tells no one."""

START_TIMEOUT_SECONDS = 30.0
"""How long `ensure_background_controller` waits for that byte. A start (imports, opening and migrating the
store) takes seconds; one slower than this is reported as still starting rather than holding the verb,
and the lock every other verb's start waits on, any longer."""

LOG_TAIL_LINES = 20
"""How many of its last log lines a failed start shows: about a Python traceback's length."""
LOG_TAIL_BYTES = 64 * 1024  # read no more of the log than those lines can take up, however much it wrote


@dataclass(frozen=True)
class StartedController:
    """A controller `ensure_background_controller` started: `ready` once it said so, else still starting."""

    pid: int
    log: Path
    ready: bool = True


def ensure_background_controller(
    state_url: str | None = None, idle_exit_seconds: float = 600.0
) -> StartedController | None:
    """Start `python -m mortal.controller` detached unless a controller runs; what was started, if any.

    "Runs" means: the pid file names a live process, or the store's leader lease is unexpired (a
    controller elsewhere). A lock file keeps two `apply`s from starting two at once; it is held until the
    new controller is ready, so the second sees it. Raises ControllerStartFailed when it exits first. The
    controller exits by itself after `idle_exit_seconds` with no work.
    """
    home = paths.mortal_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "controller.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if running_controller_pid() is not None:
            return None
        store = open_store(state_url)
        try:
            if _leader_elsewhere(store):
                return None
        finally:
            store.close()
        return _start_and_await(home, state_url, idle_exit_seconds)


def _start_and_await(home: Path, state_url: str | None, idle_exit_seconds: float) -> StartedController:
    """Start the controller with a pipe's write end and wait on the read end: its byte, or its exit (EOF)."""
    offset = log_file().stat().st_size if log_file().exists() else 0
    read_end, write_end = os.pipe()
    try:
        proc = _spawn(home, state_url, idle_exit_seconds, write_end)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)  # the child's copy is the only one left: its exit is EOF here
    _write_pid_file(proc.pid)
    with os.fdopen(read_end, "rb", buffering=0) as ready:
        outcome = _await_ready(proc, ready, START_TIMEOUT_SECONDS)
    if outcome is False:
        _remove_pid_file_of(proc.pid)
        raise ControllerStartFailed(proc.pid, proc.returncode, log_file(), _log_tail(offset))
    return StartedController(proc.pid, log_file(), ready=outcome is True)


def _spawn(home: Path, state_url: str | None, idle_exit_seconds: float, ready_fd: int) -> subprocess.Popen:
    env = dict(os.environ, MORTAL_HOME=str(home), **{READY_FD_ENV: str(ready_fd)})
    if state_url:
        env["MORTAL_STATE_URL"] = state_url
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    with os.fdopen(os.open(log_file(), flags, 0o600), "ab") as out:  # its owner's, as the store is
        return subprocess.Popen(
            [sys.executable, "-m", "mortal.controller", "--idle-exit", str(idle_exit_seconds)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=(ready_fd,),
        )


def _await_ready(proc: subprocess.Popen, ready: BinaryIO, timeout: float) -> bool | None:
    """True once the controller wrote its byte, False once it exited without one, None while it starts."""
    deadline = time.monotonic() + timeout
    readable, _, _ = select.select([ready], [], [], timeout)
    if not readable:
        return None
    if ready.read(1):
        return True
    try:  # EOF: it is exiting
        proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None  # it closed the pipe yet lives on: no verdict
    return False


def _remove_pid_file_of(pid: int) -> None:
    """Remove the pid file if it names `pid` (a later controller's is left alone)."""
    with contextlib.suppress(OSError):
        if pid_file().read_text().split(" ", 1)[0].strip() == str(pid):
            pid_file().unlink()


def _log_tail(offset: int) -> list[str]:
    """The last LOG_TAIL_LINES lines written to the controller log past `offset` (this start's)."""
    try:
        with open(log_file(), "rb") as log_:
            size = log_.seek(0, os.SEEK_END)
            log_.seek(max(offset, size - LOG_TAIL_BYTES))
            text = log_.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-LOG_TAIL_LINES:]


def _signal_ready(ready_fd: str | None) -> None:
    """Tell the `ensure_background_controller` that started this process that it has started. Only a pipe
    is written to: a variable inherited from elsewhere may name any file this process opened since."""
    if ready_fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        fd = int(ready_fd)
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            try:
                os.write(fd, b"\x01")
            finally:
                os.close(fd)


def run_controller(
    state_url: str | None = None,
    watch: Path | str | None = None,
    stop_event: threading.Event | None = None,
    config: ControllerConfig | None = None,
    idle_exit_seconds: float | None = None,
) -> None:
    """Run a controller in this process until SIGTERM/SIGINT, `stop_event`, or idleness; once its store is
    open and its threads run, tell the client that started it in the background (READY_FD_ENV)."""
    ready_fd = os.environ.pop(READY_FD_ENV, None)  # not for the workers it starts
    url = state_url or paths.default_state_url()
    store = open_store(url)
    controller = Controller(
        store, url, config, Path(watch) if watch else None, idle_exit_seconds=idle_exit_seconds
    )
    other = running_controller_pid()
    own_pid_file = other in (None, os.getpid())
    if own_pid_file:
        _write_pid_file(os.getpid())
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: controller.stopped.set())
    log.info("controller %s started on %s", controller.leader.holder, store)
    if not own_pid_file:
        log.info("this home's controller (pid %s) runs: this one stands by and leads once it stops", other)
    controller.start()
    failpoints.hit("controller:before-ready")
    _signal_ready(ready_fd)
    try:
        while not controller.stopped.wait(0.2):
            if stop_event is not None and stop_event.is_set():
                break
            if not own_pid_file and controller.leader.is_leader and running_controller_pid() is None:
                _write_pid_file(os.getpid())  # the one it stood by for stopped: `controller stop` finds this
                own_pid_file = True
    finally:
        controller.stop()
        store.close()
        if own_pid_file and running_controller_pid() == os.getpid():
            with contextlib.suppress(OSError):
                pid_file().unlink()
        log.info("controller %s stopped; workers keep running", controller.leader.holder)
