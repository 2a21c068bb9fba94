"""`python -m mortal.workers.main`: the entry point of every worker process a backend launches.

Who calls it: the backends (local: a subprocess; modal: a function call). It opens the store,
builds the WorkerContext, picks the workload (the role's module, or mortal.workers.simulated when
the run is annotated `mortal.dev/workload: simulated`), runs `main(ctx)` and turns how it ended
into the worker's last report and exit code:

    returned 0               report Succeeded, exit 0   (stopped on request: no report, exit 0)
    returned n != 0          report Failed n, exit n
    FatalWorkerError         report Failed 3 "Reason: message", exit 3
    out of GPU memory        report Failed 4 "OutOfMemory: tried to allocate ... on GPU 0 (...)", exit 4
                             (torch.cuda.OutOfMemoryError, CUDA's or NCCL's out-of-memory: mortal.workers.oom)
    Fenced anywhere          no report, exit 76 at once
    any other exception      traceback to the log, report Failed 75, exit 75 (SystemExit and KeyboardInterrupt
                             too: user code calling sys.exit does not end a worker as if it had finished)

What it must not do: decide about the run. The controller reads the report and the exit code.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Mapping
from types import ModuleType

from mortal.state import open_store, paths
from mortal.state.errors import Fenced
from mortal.state.log_rotation import LogCap
from mortal.state.store import WORKER_LEADER_ENV, Store, WorkerRef
from mortal.workers.errors import FatalWorkerError
from mortal.workers.oom import REASON as OUT_OF_MEMORY
from mortal.workers.oom import out_of_memory, with_device_state
from mortal.workers.runtime import (
    EXIT_FATAL,
    EXIT_OUT_OF_MEMORY,
    EXIT_RETRYABLE,
    EXIT_SUCCEEDED,
    WorkerContext,
    exit_fenced,
    pin_cpu_threads,
    worker_ref_from_env,
)

WORKLOAD_ANNOTATION = "mortal.dev/workload"
WORKLOADS = {"simulated": "mortal.workers.simulated"}
ROLE_MODULES = {"actor": "mortal.workers.actor.loop", "rollout": "mortal.workers.rollout.loop"}
log = logging.getLogger("mortal.worker")


def workload_module(ctx: WorkerContext) -> ModuleType:
    """The module whose `main(ctx)` this worker runs."""
    workload = ctx.run.metadata.annotations.get(WORKLOAD_ANNOTATION)
    if workload is not None:
        if workload not in WORKLOADS:
            raise FatalWorkerError(
                "UnknownWorkload",
                f"annotation {WORKLOAD_ANNOTATION}={workload!r}; known: {sorted(WORKLOADS)}",
            )
        return importlib.import_module(WORKLOADS[workload])
    if ctx.worker.role not in ROLE_MODULES:
        raise FatalWorkerError("UnknownRole", f"role {ctx.worker.role!r}; known: {sorted(ROLE_MODULES)}")
    return importlib.import_module(ROLE_MODULES[ctx.worker.role])


def use_code_snapshot(env: Mapping[str, str], worker: WorkerRef) -> str | None:
    """Import from, and run in, the run's code snapshot (MORTAL_CODE_SNAPSHOT, mortal.controller.snapshot):
    the reward modules and data files of the folder the run was applied from, wherever the controller runs.
    First on sys.path and PYTHONPATH (processes the worker starts see it too); its folder, the working one."""
    digest = env.get(paths.CODE_SNAPSHOT_ENV)
    if not digest:
        return None
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise FatalWorkerError(
            "CodeSnapshotMissing", f"{paths.CODE_SNAPSHOT_ENV}={digest!r} is not a sha256 digest"
        )
    folder = paths.code_dir(worker.run, digest, env.get("MORTAL_HOME") or None)
    if not folder.is_dir():
        raise FatalWorkerError(
            "CodeSnapshotMissing",
            f"the run's code snapshot {folder} is not on this "
            "machine (apply the run again from the folder of its code)",
        )
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    os.chdir(folder)
    return str(folder)


def seconds_since_exec() -> float:
    """How long this process has existed: the interpreter's start and main's own imports, before any log
    line."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


def configure_logging(worker: WorkerRef) -> None:
    """One line per record on stderr (the backend sends it to the worker's log file)."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=(
            f"%(asctime)s %(levelname)s {worker.role}-{worker.replica}#{worker.incarnation} "
            "%(name)s: %(message)s"
        ),
        force=True,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)


def run_worker(environ: Mapping[str, str] | None = None) -> int:
    """Run this process's workload to its end; returns the exit code (exits 76 itself when fenced)."""
    env = os.environ if environ is None else environ
    worker = worker_ref_from_env(env)
    configure_logging(worker)
    log.info(
        "starting (pid %d, CUDA_VISIBLE_DEVICES=%r, %.1f s after exec)",
        os.getpid(),
        os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        seconds_since_exec(),
    )
    started = time.monotonic()
    store = open_store(env.get("MORTAL_STATE_URL"))
    ctx: WorkerContext | None = None
    try:
        ctx = WorkerContext.from_env(store, env)
        code = use_code_snapshot(env, worker)
        if code is not None:
            log.info("importing the run's code from %s", code)
        pin_cpu_threads(worker.role, ctx.run)
        ctx.start()
        context_ready = time.monotonic()
        module = workload_module(ctx)
        # a GPU run's first step waits on this start; the two figures say whether the store or the imports
        # (torch, transformers, TRL) are the part to shorten
        log.info(
            "workload %s imported in %.1f s (store and context took %.1f s)",
            module.__name__,
            time.monotonic() - context_ready,
            context_ready - started,
        )
        returned = module.main(ctx)
        code = EXIT_SUCCEEDED if returned is None else int(returned)
    except Fenced as exc:
        exit_fenced(exc)
    except FatalWorkerError as exc:
        log.error("fatal: %s", exc)
        return _finish(store, worker, ctx, EXIT_FATAL, str(exc))
    except Exception as exc:
        log.error("crashed:\n%s", traceback.format_exc())
        oom = out_of_memory(exc)
        if oom is not None:
            oom = with_device_state(oom)
            log.error("out of GPU memory: %s", oom.describe())
            return _finish(store, worker, ctx, EXIT_OUT_OF_MEMORY, f"{OUT_OF_MEMORY}: {oom.describe()}")
        return _finish(store, worker, ctx, EXIT_RETRYABLE, f"{type(exc).__name__}: {exc}"[:500])
    except (SystemExit, KeyboardInterrupt) as exc:  # user code run on this thread (an environment built here)
        log.error("crashed:\n%s", traceback.format_exc())
        said = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return _finish(store, worker, ctx, EXIT_RETRYABLE, f"{said} raised inside the workload"[:500])
    stopped = ctx.stopping.is_set()
    return _finish(store, worker, ctx, code, None if code == 0 else f"exited with code {code}", stopped)


def _finish(
    store: Store,
    worker: WorkerRef,
    ctx: WorkerContext | None,
    code: int,
    message: str | None,
    stopped: bool = False,
) -> int:
    """Stop heartbeating, then write the worker's last word (none when it was stopped on request)."""
    if ctx is not None:
        ctx.close()
    if stopped and code == EXIT_SUCCEEDED:
        log.info("stopped on request")
        return code
    try:
        store.report_exit(worker, "Succeeded" if code == EXIT_SUCCEEDED else "Failed", code, message)
    except Fenced as exc:
        exit_fenced(exc)
    except Exception as exc:  # the exit code still tells the controller
        log.warning("could not report exit %d: %s", code, exc)
    log.info("exiting with code %d", code)
    return code


def main() -> None:
    os.environ[WORKER_LEADER_ENV] = "0"  # this process is the worker; its children are not (state.store)
    LogCap().start()  # the log file the backend gave stdout and stderr (state/log_rotation.py)
    try:
        code = run_worker()
    except Exception:  # before the store was open (bad environment, database unreachable): nothing to report
        log.error("could not start:\n%s", traceback.format_exc())
        code = EXIT_RETRYABLE
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no waiting on threads a workload left running


if __name__ == "__main__":
    main()
