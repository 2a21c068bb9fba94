"""The body of the Modal worker function: one mortal worker process per Modal function call.

Who calls it: the `worker` function of mortal.controller.modal_app (in a Modal container, once per
`ModalBackend.launch`), and the tests' Modal fake, which runs it in a subprocess as its "container".
It starts `python -m mortal.workers.main` with the worker protocol's environment and returns the
worker's exit code, which `FunctionCall.get` then hands to the controller (negative -N when signal N
killed it, as in subprocess).

Stopping: `FunctionCall.cancel()` raises `modal.exception.InputCancellation` in this function (a
SIGUSR1 handler Modal installs); so does anything else that interrupts the wait. The worker's process
group is then sent SIGTERM (it stops at a step boundary and exits 0 without a report), and SIGKILL
after `stop_grace` seconds, before the exception goes on.
What it must not do: import modal (the fake runs it without), decide anything, or relaunch the worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from mortal.controller.backends.base import WORKER_MODULE, WorkerLaunch, signal_group

STOP_GRACE_SECONDS = 10.0


def run_worker(launch: Mapping[str, Any], stop_grace: float = STOP_GRACE_SECONDS) -> int:
    """Run the worker `launch` describes (WorkerLaunch fields) to its end; its exit code.

    MORTAL_HOME is this container's own when set (the app mounts the shared volume there), so a
    controller elsewhere, with another home, still gets checkpoints onto the volume.
    """
    spec = WorkerLaunch(**launch)
    env = spec.environ(os.environ, cuda_visible_devices=None, mortal_home=os.environ.get("MORTAL_HOME"))
    proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        stop_worker(proc, stop_grace)
        raise


def stop_worker(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the worker's group, SIGKILL it after `grace` seconds, reap."""
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    signal_group(proc.pid, signal.SIGKILL)  # also what the worker left behind in its group
    proc.wait()
