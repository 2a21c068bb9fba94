"""The body of the Modal worker functions: one mortal worker process per Modal function call.

Who calls it: the `worker` and `rollout_vllm` functions of mortal.client.modal_app (once per
`ModalBackend.launch`), and the tests' Modal fake, in a subprocess. It runs `python -m mortal.workers.main`
and returns its exit code (-N when signal N killed it) to `FunctionCall.get`. The output goes to
Modal's logs and to the run's log file on the data volume, committed every LOG_COMMIT_SECONDS, so
`mortalctl logs` sees it. A cancel (or a preemption) interrupts the wait: the worker's group gets
SIGTERM, then SIGKILL after `stop_grace` seconds.
What it must not do: import modal (the fake runs it without), decide anything, or relaunch the worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from mortal.controller.backends.base import WORKER_MODULE, WorkerLaunch, signal_group
from mortal.state import log_rotation, paths

STOP_GRACE_SECONDS = 10.0
LOG_COMMIT_SECONDS = 10.0  # how stale `mortalctl logs` may be for a worker on Modal
DRAIN_SECONDS = 5.0  # how long the worker's last output may take to arrive after it exits (a child's pipe)


def run_worker(
    launch: Mapping[str, Any],
    stop_grace: float = STOP_GRACE_SECONDS,
    commit: Callable[[], None] | None = None,
) -> int:
    """Run the worker `launch` describes (WorkerLaunch fields) to its end; its exit code.

    MORTAL_HOME is this container's own when set (the app mounts the shared volume there), so a
    controller elsewhere, with another home, still gets checkpoints and logs onto the volume.
    """
    spec = WorkerLaunch(**launch)
    home = os.environ.get("MORTAL_HOME") or spec.mortal_home
    env = spec.environ(os.environ, cuda_visible_devices=None, mortal_home=home)
    log = Path(home) / paths.worker_log(spec.run, spec.role, spec.replica, spec.incarnation).relative_to(
        paths.mortal_home()
    )
    return run_logged([sys.executable, "-m", WORKER_MODULE], env, log, stop_grace, commit)


def run_logged(
    command: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    stop_grace: float = STOP_GRACE_SECONDS,
    commit: Callable[[], None] | None = None,
    commit_every: float = LOG_COMMIT_SECONDS,
) -> int:
    """Run `command` in a process group of its own, its output teed to stdout and appended to `log`,
    `commit` called while output grows and at the end; its exit code. Stopped as the module says."""
    # the log opens first: a volume that refuses it starts nothing; capped as the worker's environment says
    tee = _Tee(log, commit, commit_every, log_rotation.max_bytes(env))
    try:
        proc = subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        tee.close()
        raise
    assert proc.stdout is not None
    tee.start(proc.stdout)
    try:
        return proc.wait()
    except BaseException:
        stop_worker(proc, stop_grace)
        raise
    finally:
        tee.close()


def stop_worker(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the worker's group, SIGKILL it after `grace` seconds, reap."""
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    signal_group(proc.pid, signal.SIGKILL)  # also what the worker left behind in its group
    proc.wait()


class _Tee:
    """Copies a pipe to stdout and a log file (thread `copy`); commits the file's volume (thread `sync`)."""

    def __init__(self, log: Path, commit: Callable[[], None] | None, every: float, limit: int) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(log, "ab")  # noqa: SIM115 - closed in close(), after the copy thread
        self._path, self._limit = log, limit  # the file's size cap in bytes, 0: none (state/log_rotation.py)
        self._commit, self._every = commit, every
        self._pipe: IO[bytes] | None = None
        self._written, self._committed = 0, 0
        # Held while a chunk is written and counted, and while a commit runs: so a commit covers exactly the
        # bytes counted (no second commit of the same content when output lands during one). A slow commit
        # makes output wait in the pipe meanwhile (64 KB before the worker's own writes would block).
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._copy = threading.Thread(target=self._copy_all, name="mortal-log-copy", daemon=True)
        self._sync = threading.Thread(target=self._sync_while_running, name="mortal-log-commit", daemon=True)

    def start(self, pipe: IO[bytes]) -> None:
        self._pipe = pipe
        self._copy.start()
        self._sync.start()

    def _copy_all(self) -> None:
        assert self._pipe is not None
        while chunk := os.read(self._pipe.fileno(), 65536):
            with self._lock:
                self._cap(len(chunk))
                self._file.write(chunk)
                self._file.flush()
                self._written += len(chunk)
            _echo(chunk)

    def _cap(self, coming: int) -> None:
        """Rotate the file before `coming` bytes would take it past its cap (so the newest output is in the
        log itself); a failure only leaves it growing."""
        try:
            size = os.fstat(self._file.fileno()).st_size
            if self._limit and size and size + coming > self._limit:
                log_rotation.rotate(self._file.fileno(), self._path)
        except OSError as exc:
            self._limit = 0
            print(f"mortal: the log's size cap stops: {exc}", file=sys.stderr, flush=True)

    def _sync_while_running(self) -> None:
        while not self._closed.wait(self._every):
            self._sync_once()

    def _sync_once(self) -> None:
        """Commit if there is output the last commit did not include; a failure only costs staleness."""
        if self._commit is None or self._written == self._committed:
            return
        try:
            with self._lock:
                written = self._written
                if not self._file.closed:
                    # A commit may leave out what a file open for writing holds unsynced.
                    os.fsync(self._file.fileno())
                self._commit()
                self._committed = written
        except Exception as exc:  # noqa: BLE001 - the worker's run matters more than its log's freshness
            print(f"mortal: could not commit the log to the volume: {exc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """The last output (waiting at most DRAIN_SECONDS), then the last commit. A pipe some leftover
        process still holds stays open (its copy thread dies with this process)."""
        if self._pipe is not None:
            self._copy.join(DRAIN_SECONDS)
            self._closed.set()
            self._sync.join()
            self._sync_once()
        if not self._copy.is_alive():
            self._file.close()
            if self._pipe is not None:
                self._pipe.close()


def _echo(chunk: bytes) -> None:
    """To file descriptor 1, where the worker's output went before it was teed (Modal's logs capture
    it); a closed stdout only loses the echo."""
    view = memoryview(chunk)
    with contextlib.suppress(OSError):
        while view:
            view = view[os.write(1, view) :]
