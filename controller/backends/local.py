"""The local backend: one OS process (own session and process group) per worker on this machine.

Who calls it: the controller, through the `Backend` contract. A worker is
`python -m mortal.workers.main` with the protocol's MORTAL_* environment; its output is appended to
mortal.state.paths.worker_log. The handle is "PID:CREATE_TIME" so a reused pid is never mistaken
for the worker. `list()` finds workers by scanning processes for MORTAL_WORKER_ID and this MORTAL_HOME in
their environment, less those the leader mark says are a worker's children (state.store.WORKER_LEADER_ENV),
so a restarted controller re-adopts workers an earlier one launched (even ones it launched and never
recorded). GPUs go out with CUDA_VISIBLE_DEVICES.
What it must not do: touch the store, or leave a process behind: `stop` kills the whole group and what
carries the worker's id; the controller stops every ended worker's handle, one that died included.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from mortal.controller.backends import gpus
from mortal.controller.backends.base import (
    DOORBELLS_ENV,
    EXITED_TTL_SECONDS,
    GPU_PEERS_ENV,
    WORKER_MODULE,
    Backend,
    BackendWorker,
    LaunchFailed,
    WaitingForActorGPU,
    WorkerLaunch,
    signal_group,
)
from mortal.state import paths
from mortal.state.containment import PathOutside, inside
from mortal.state.store import WORKER_LEADER_ENV


@dataclass(frozen=True)
class _Found:
    """A live worker process seen in the process table."""

    worker: BackendWorker
    devices: tuple[str, ...]
    shared: bool = False  # colocated: uses its actor's devices, holds none of its own


class _Registry:
    """What this controller process knows beyond the process table about one home's workers,
    shared by every LocalBackend of that home.

    Children it launched (their Popen: exit codes, and reaping so none stays a zombie), and workers
    it has seen alive (so one that vanished is reported as exited, exit code unknown). Entries go
    when `stop` is called on their handle, or EXITED_TTL_SECONDS after the exit was first listed
    (then the handle is simply absent: gone, as the contract allows).
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.children: dict[str, tuple[subprocess.Popen[bytes], _Found]] = {}
        self.seen: dict[str, BackendWorker] = {}
        self.exited_at: dict[str, float] = {}

    def forget(self, handle: str) -> None:
        self.children.pop(handle, None)
        self.seen.pop(handle, None)
        self.exited_at.pop(handle, None)


_REGISTRIES: dict[str, _Registry] = {}
_REGISTRIES_LOCK = threading.Lock()


def _registry(home: str) -> _Registry:
    with _REGISTRIES_LOCK:
        return _REGISTRIES.setdefault(home, _Registry())


def make_handle(pid: int, create_time: float) -> str:
    return f"{pid}:{create_time:.2f}"


def parse_handle(handle: str) -> tuple[int, str]:
    pid, _, ctime = handle.partition(":")
    return int(pid), ctime


class LocalBackend(Backend):
    """Workers as local processes, scoped to one MORTAL_HOME."""

    name = "local"

    def __init__(
        self,
        home: str | Path | None = None,
        detect_gpus: Callable[[], list[str]] | None = None,
        command: list[str] | None = None,
    ) -> None:
        """`home` defaults to $MORTAL_HOME; `detect_gpus` and `command` (the worker's argv) are
        replaceable for tests and for running a worker under another interpreter."""
        self.home = os.path.realpath(home if home is not None else paths.mortal_home())
        self._detect_gpus = detect_gpus or gpus.detect_gpus
        self._command = command or [sys.executable, "-m", WORKER_MODULE]
        self._reg = _registry(self.home)

    # -- launch ------------------------------------------------------------------------------
    def launch(self, launch: WorkerLaunch) -> str:
        """Start the worker (or return the handle of the live process already running this worker id)."""
        if os.path.realpath(launch.mortal_home) != self.home:
            raise ValueError(
                f"launch for MORTAL_HOME {launch.mortal_home} given to the backend of {self.home}"
            )
        with self._reg.lock:
            live = self._live()
            for f in live.values():
                if f.worker.worker_id == launch.worker_id:
                    return f.worker.handle
            visible = self._devices_for(launch, live)
            peers = (
                tuple(d for d in self._actor_devices(launch, live) if d not in gpus.parse_visible(visible))
                if launch.sees_actor_gpus and visible
                else ()
            )
            proc = self._spawn(launch, ",".join(filter(None, [visible, *peers])), peers)
            handle = make_handle(proc.pid, psutil.Process(proc.pid).create_time())
            worker = _worker_from(launch, handle)
            self._reg.children[handle] = (
                proc,
                _Found(worker, gpus.parse_visible(visible), shared=launch.colocate),
            )
            self._reg.seen[handle] = worker
            return handle

    def _devices_for(self, launch: WorkerLaunch, live: dict[str, _Found]) -> str:
        """CUDA_VISIBLE_DEVICES of a new worker. A colocated rollout shares one of its live actor's devices
        (replica r the actor's r-th, round the actor's devices: one actor GPU, or each rank's in turn);
        anyone else takes free ones, where colocated workers hold none, and the devices the run's
        colocated rollouts already use come first (a relaunched actor returns to them)."""
        if not gpus.wants_gpu(launch.gpu):
            return ""
        if launch.colocate:
            actor = self._actor_devices(launch, live)
            return actor[launch.replica % len(actor)]
        devices = self._detect_gpus()
        mine = {d for f in live.values() if f.shared and _same_run(f.worker, launch) for d in f.devices}
        devices = [d for d in devices if d in mine] + [d for d in devices if d not in mine]
        in_use = (d for f in live.values() if not f.shared for d in f.devices)
        return gpus.assign(launch.gpu, launch.gpu_count, devices, in_use)

    @staticmethod
    def _actor_devices(launch: WorkerLaunch, live: dict[str, _Found]) -> tuple[str, ...]:
        """The devices the run's live actor holds; WaitingForActorGPU until it holds some."""
        actor = [
            f
            for f in live.values()
            if _same_run(f.worker, launch) and f.worker.role == "actor" and not f.shared and f.devices
        ]
        if not actor:
            raise WaitingForActorGPU(launch.run, launch.gpu)
        return actor[0].devices

    def _spawn(
        self, launch: WorkerLaunch, visible: str, peers: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """Start the worker; `peers` (in `visible` after its own devices) are seen but not held."""
        log_path = _log_path(launch)
        env = launch.environ(os.environ, visible)
        # The run's processes share this machine and its folder: they ring (workers/doorbell.py).
        env[DOORBELLS_ENV] = "1"
        if peers:
            env[GPU_PEERS_ENV] = ",".join(peers)
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with _open_log(launch, log_path) as log:
                return subprocess.Popen(
                    self._command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        except (OSError, PathOutside) as exc:
            raise LaunchFailed(f"could not start {launch.worker_id}: {exc}") from exc

    # -- list --------------------------------------------------------------------------------
    def list(self, run: str | None = None) -> list[BackendWorker]:
        with self._reg.lock:
            live = {h: f.worker for h, f in self._live().items()}
            for handle, worker in live.items():
                self._reg.seen.setdefault(handle, worker)
            out = dict(live)
            now = time.monotonic()
            for handle, worker in list(self._reg.seen.items()):
                if handle in live:
                    continue
                if now - self._reg.exited_at.setdefault(handle, now) > EXITED_TTL_SECONDS:
                    self._reg.forget(handle)
                    continue
                child = self._reg.children.get(handle)
                out[handle] = replace(worker, alive=False, exit_code=child[0].returncode if child else None)
        workers = [w for w in out.values() if run is None or w.run == run]
        return sorted(workers, key=lambda w: (w.run, w.role, w.replica, w.incarnation))

    def _live(self) -> dict[str, _Found]:
        """Live workers by handle: the process table, plus our children still running (a process
        that is just exec'ing shows no environment yet)."""
        live = {f.worker.handle: f for f in self._scan()}
        for handle, (proc, found) in self._reg.children.items():
            if proc.poll() is None:  # polling also reaps: no zombie stays behind
                live.setdefault(handle, found)
            else:
                live.pop(handle, None)
        return live

    def _scan(self) -> builtins.list[_Found]:
        """Live worker processes of this home: the processes carrying MORTAL_WORKER_ID, not marked as a
        worker's descendant (WORKER_LEADER_ENV "0"), that lead their process group and whose parent is not the
        same worker (its descendants inherit the id)."""
        candidates: dict[int, tuple[psutil.Process, dict[str, str]]] = {}
        for proc in psutil.process_iter(["environ", "ppid"]):
            env = proc.info.get("environ")
            if (
                env
                and "MORTAL_WORKER_ID" in env
                and os.path.realpath(env.get("MORTAL_HOME", "")) == self.home
            ):
                candidates[proc.pid] = (proc, env)
        found: list[_Found] = []
        for proc, env in candidates.values():
            parent = candidates.get(proc.info.get("ppid") or 0)
            if parent is not None and parent[1]["MORTAL_WORKER_ID"] == env["MORTAL_WORKER_ID"]:
                continue
            if env.get(WORKER_LEADER_ENV) == "0":  # a worker's descendant (absent: an earlier controller's)
                continue
            worker = _inspect(proc, env)
            if worker is not None:
                peers = set(gpus.parse_visible(env.get(GPU_PEERS_ENV)))
                held = tuple(d for d in gpus.parse_visible(env.get("CUDA_VISIBLE_DEVICES")) if d not in peers)
                found.append(_Found(worker, held, shared=env.get("MORTAL_GPU_SHARED") == "1"))
        return found

    def dump_stacks(self, handle: str) -> bool:
        """SIGUSR1 to the worker's own process (not its group: its children, a sandbox or a compile worker,
        may not handle it), which faulthandler answers with every thread's stack in the worker's log."""
        pid, ctime = parse_handle(handle)
        if not _matches(pid, ctime):
            return False
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGUSR1)  # mortal.workers.deadline.STACK_DUMP_SIGNAL
            return True
        return False

    # -- stop --------------------------------------------------------------------------------
    def stop(self, handle: str, grace_seconds: float = 5.0) -> None:
        """SIGTERM the worker's process group, SIGKILL what is left after `grace_seconds`, then kill
        descendants that left the group (they still carry the worker id), and reap."""
        pid, ctime = parse_handle(handle)
        with self._reg.lock:
            child = self._reg.children.get(handle)
            known = self._reg.seen.get(handle)
        popen = child[0] if child else None
        worker_id = known.worker_id if known else None
        if _matches(pid, ctime):
            if worker_id is None:
                with contextlib.suppress(psutil.Error):
                    worker_id = psutil.Process(pid).environ().get("MORTAL_WORKER_ID")
            signal_group(pid, signal.SIGTERM)
            if not _wait_group_gone(pid, popen, grace_seconds):
                signal_group(pid, signal.SIGKILL)
                _wait_group_gone(pid, popen, 10.0)
        self._kill_strays(pid, worker_id)
        if popen is not None:
            try:
                popen.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        with self._reg.lock:
            self._reg.forget(handle)

    def _kill_strays(self, pgid: int, worker_id: str | None) -> None:
        """SIGKILL what the worker left: processes of this home in its group or carrying its id."""
        strays = []
        for proc in psutil.process_iter(["environ"]):
            env = proc.info.get("environ") or {}
            if "MORTAL_WORKER_ID" not in env or os.path.realpath(env.get("MORTAL_HOME", "")) != self.home:
                continue
            try:
                if env["MORTAL_WORKER_ID"] == worker_id or os.getpgid(proc.pid) == pgid:
                    proc.kill()
                    strays.append(proc)
            except (psutil.Error, ProcessLookupError):
                continue
        psutil.wait_procs(strays, timeout=10.0)


def _same_run(worker: BackendWorker, launch: WorkerLaunch) -> bool:
    """A worker of the launch's run: its name and uid (not a straggler of an earlier run of that name)."""
    return worker.run == launch.run and worker.run_uid == launch.run_uid


def _worker_from(launch: WorkerLaunch, handle: str) -> BackendWorker:
    return BackendWorker(
        worker_id=launch.worker_id,
        handle=handle,
        run=launch.run,
        role=launch.role,
        replica=launch.replica,
        incarnation=launch.incarnation,
        alive=True,
        run_uid=launch.run_uid,
    )


def _inspect(proc: psutil.Process, env: dict[str, str]) -> BackendWorker | None:
    """The BackendWorker of a worker's leader process, None for its descendants or on a race."""
    try:
        if os.getpgid(proc.pid) != proc.pid or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        handle = make_handle(proc.pid, proc.create_time())
        return BackendWorker(
            worker_id=env["MORTAL_WORKER_ID"],
            handle=handle,
            run=env.get("MORTAL_RUN", ""),
            role=env.get("MORTAL_ROLE", ""),
            replica=int(env.get("MORTAL_REPLICA", "0")),
            incarnation=int(env.get("MORTAL_INCARNATION", "0")),
            alive=True,
            run_uid=env.get("MORTAL_RUN_UID", ""),
        )
    except (psutil.Error, ProcessLookupError, ValueError):
        return None


def _matches(pid: int, ctime: str) -> bool:
    """The process `pid` exists (maybe as a zombie) and is the one the handle was made for."""
    try:
        return make_handle(pid, psutil.Process(pid).create_time()) == f"{pid}:{ctime}"
    except psutil.Error:
        return False


def _wait_group_gone(pgid: int, popen: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    """Wait until no process is left in the group (reaping our child leader as it exits)."""
    deadline = time.monotonic() + timeout
    while True:
        if popen is not None:
            popen.poll()
        if not _group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """Some process of the group still runs (zombies waiting for another parent to reap them do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, ProcessLookupError):
            continue
    return False


def _open_log(launch: WorkerLaunch, log_path: Path) -> io.BufferedWriter:
    """The worker's log opened for appending, kept inside the run's folder: a logs folder or a log file that
    links elsewhere (planted by the run's own code for a later incarnation) is refused, never written
    through (PathOutside, or ELOOP from O_NOFOLLOW should a link appear after the check)."""
    inside(paths.run_dir(launch.run, launch.mortal_home), log_path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
    return os.fdopen(os.open(log_path, flags, 0o600), "ab")  # its owner's: user code may print secrets


def _log_path(launch: WorkerLaunch) -> Path:
    """paths.worker_log, under the launch's MORTAL_HOME (which may differ from this process's)."""
    rel = paths.worker_log(launch.run, launch.role, launch.replica, launch.incarnation).relative_to(
        paths.mortal_home()
    )
    return Path(launch.mortal_home) / rel
