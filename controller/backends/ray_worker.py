"""The body of a mortal worker's Ray actor: it runs one `python -m mortal.workers.main` and keeps its exit code.

Who calls it: Ray, on a node of the cluster, when `RayBackend.launch` creates the named detached actor
(`ray.remote(WorkerHost).options(...).remote(launch, command)`); then the backend's `status` and
`stop` calls. The constructor starts the worker process at once, so an actor that exists is a worker
that was started (a controller killed between "create" and "start" cannot leave an idle actor).

The process: the launch's environment (`WorkerLaunch.environ`, the same protocol every backend
gives), CUDA_VISIBLE_DEVICES as Ray set it for this actor's GPUs (empty on CPU), its own session and
process group, output appended to the run's log file under MORTAL_HOME (`mortalctl logs` reads it:
the cluster's nodes share that folder, docs/ray.md), and on Linux a parent-death signal: if this
actor's process dies (its node is lost, Ray kills it), the worker dies with it instead of running on
as an orphan nobody lists.
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
from pathlib import Path
from typing import Any

from mortal.controller.backends.base import WorkerLaunch, signal_group
from mortal.controller.backends.gpus import wants_gpu
from mortal.state import paths

PR_SET_PDEATHSIG = 1  # linux/prctl.h


class WorkerHost:
    """One worker process and what is known of it; Ray calls the methods from its threads (max_concurrency > 1)."""

    def __init__(self, launch: dict[str, Any], command: Sequence[str]) -> None:
        spec = WorkerLaunch(**launch)
        self.worker_id = spec.worker_id
        devices = os.environ.get("CUDA_VISIBLE_DEVICES", "") if spec.gpu_count and wants_gpu(spec.gpu) else ""
        env = spec.environ(os.environ, cuda_visible_devices=devices)
        log = Path(spec.mortal_home) / paths.worker_log(spec.run, spec.role, spec.replica, spec.incarnation) \
            .relative_to(paths.mortal_home())
        log.parent.mkdir(parents=True, exist_ok=True)
        self._exit_code: int | None = None
        self._lock = threading.Lock()
        started = threading.Event()
        failure: list[BaseException] = []
        # The process is started and waited for by one thread that lives exactly as long as the process:
        # the parent-death signal fires when the thread that forked the child ends, not only the process.
        self._waiter = threading.Thread(target=self._run, args=(list(command), env, log, started, failure),
                                        name="mortal-worker", daemon=True)
        self._waiter.start()
        started.wait()
        if failure:
            raise failure[0]

    def _run(self, command: list[str], env: dict[str, str], log: Path, started: threading.Event,
             failure: list[BaseException]) -> None:
        try:
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                              preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except BaseException as exc:  # handed to the constructor, which raises it: the actor's creation fails
            failure.append(exc)
            started.set()
            return
        started.set()
        code = self._proc.wait()
        with self._lock:
            self._exit_code = code

    def status(self) -> dict[str, Any]:
        """The worker's exit code (None while it runs; -N when signal N ended it) and this actor's node."""
        import ray

        with self._lock:
            code = self._exit_code
        return {"worker_id": self.worker_id, "exit_code": code, "pid": self._proc.pid,
                "node_id": ray.get_runtime_context().get_node_id()}

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
