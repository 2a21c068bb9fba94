"""The body of a mortal worker's Ray actor: it runs one `python -m mortal.workers.main` and keeps its
exit code.

Who calls it: Ray, on a node of the cluster, when `RayBackend.launch` creates the named detached actor;
then the backend's `status` and `stop`. The constructor starts the worker at once, so an actor that
exists is a worker that was started. The process gets the launch's environment (the protocol every
backend gives), its own process group, output appended to the run's log, and on Linux a parent-death
signal, so a worker never outlives its actor as an orphan nobody lists. Where the nodes share no
MORTAL_HOME, the log is uploaded to the run's storage for `mortalctl logs` (StorageLogs).
What it must not do: import the store, decide anything, or restart the worker (the controller does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from mortal.controller.backends.base import (
    RAY_ADDRESS_ENV,
    RAY_NAMESPACE_ENV,
    RAY_NODE_ENV,
    WorkerLaunch,
    signal_group,
)
from mortal.controller.backends.gpus import wants_gpu
from mortal.controller.logs import LOG_UPLOAD_SECONDS, storage_log_url
from mortal.controller.snapshot import unpack
from mortal.state import log_rotation, paths

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerHost:
    """One worker process and what is known of it; Ray calls the methods from its threads
    (max_concurrency > 1)."""

    def __init__(
        self, launch: dict[str, Any], command: Sequence[str], namespace: str = "", code: bytes | None = None
    ) -> None:
        """`namespace`: the run's (the actor's name is in it; Ray's runtime context gives the creating job's);
        `code`: the run's code snapshot (mortal.controller.snapshot.archive) when this node has its own
        home."""
        import ray

        spec = WorkerLaunch(**launch)
        self.worker_id = spec.worker_id
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "") if spec.gpu_count and wants_gpu(spec.gpu) else ""
        home = str(paths.mortal_home()) if spec.node_home else spec.mortal_home
        if spec.node_home and code is not None:
            unpack(code, spec.run, spec.env, home)  # the run's code snapshot, into the node's own MORTAL_HOME
        env = spec.environ(os.environ, cuda_visible_devices=devices, mortal_home=home)
        context = ray.get_runtime_context()
        env.update(
            {
                RAY_ADDRESS_ENV: context.gcs_address,
                RAY_NAMESPACE_ENV: namespace,
                RAY_NODE_ENV: context.get_node_id(),
            }
        )
        log = Path(home) / paths.worker_log(spec.run, spec.role, spec.replica, spec.incarnation).relative_to(
            paths.mortal_home()
        )
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._log_url = storage_log_url(spec.log_uri, spec.run, log.name) if spec.log_uri else None
        self._uploaded: tuple[int, object] = (-1, None)  # the log's size and its rotated file's when uploaded
        self._exit_code: int | None = None
        self._lock = threading.Lock()
        started = threading.Event()
        failure: list[BaseException] = []
        # The process is started and waited for by one thread that lives exactly as long as the process:
        # the parent-death signal fires when the thread that forked the child ends, not only the process.
        self._waiter = threading.Thread(
            target=self._run,
            args=(list(command), env, log, started, failure),
            name="mortal-worker",
            daemon=True,
        )
        self._waiter.start()
        started.wait()
        if failure:
            raise failure[0]

    def _run(
        self,
        command: list[str],
        env: dict[str, str],
        log: Path,
        started: threading.Event,
        failure: list[BaseException],
    ) -> None:
        try:
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
        except BaseException as exc:  # handed to the constructor, which raises it: the actor's creation fails
            failure.append(exc)
            started.set()
            return
        started.set()
        while True:
            try:
                code = self._proc.wait(timeout=LOG_UPLOAD_SECONDS if self._log_url else None)
                break
            except subprocess.TimeoutExpired:
                self._upload_log()
        self._upload_log()  # the last lines, before the exit code tells the controller to kill this actor
        with self._lock:
            self._exit_code = code

    def _upload_log(self) -> None:
        """Copy the log file to the run's storage when it grew; best effort (a failed upload is said in this
        actor's own output and tried again later: the worker must not fail for its log)."""
        if self._log_url is None:
            return
        import fsspec

        try:
            size, stamp = self.log.stat().st_size, log_rotation.rotation_stamp(self.log)
            if (size, stamp) == self._uploaded:
                return
            fs, path = fsspec.core.url_to_fs(self._log_url)
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(self.log), path)  # first: a reader that sees a new <log>.1 sees the log emptied
            if stamp is not None and stamp != self._uploaded[1]:
                rotated = log_rotation.rotated_path(self.log)
                fs.put_file(str(rotated), str(log_rotation.rotated_path(PurePosixPath(path))))
            self._uploaded = (size, stamp)
        except (OSError, ValueError, ImportError) as exc:
            print(
                f"mortal: could not upload {self.log} to {self._log_url}: {exc}", file=sys.stderr, flush=True
            )

    def status(self) -> dict[str, Any]:
        """The worker's exit code (None while it runs; -N when signal N ended it) and this actor's node."""
        import ray

        with self._lock:
            code = self._exit_code
        return {
            "worker_id": self.worker_id,
            "exit_code": code,
            "pid": self._proc.pid,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def dump_stacks(self) -> bool:
        """SIGUSR1 to the worker's own process (not its group: its children may not handle it), which
        faulthandler answers with every thread's stack in the worker's log (mortal.workers.deadline); False
        once it has exited."""
        if self._proc.poll() is not None:
            return False
        try:
            os.kill(self._proc.pid, signal.SIGUSR1)  # mortal.workers.deadline.STACK_DUMP_SIGNAL
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace_seconds: float) -> int | None:
        """SIGTERM the worker's process group (it checkpoints and exits 0), SIGKILL what is left after
        `grace_seconds`; its exit code."""
        if self._proc.poll() is None and grace_seconds > 0:
            signal_group(self._proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace_seconds)
        signal_group(self._proc.pid, signal.SIGKILL)  # and whatever the worker left in its group
        self._waiter.join()
        return self._exit_code


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it (the actor's waiter) ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
