"""Run one TrainingRun through a real controller and read back its per-step metrics (for bench/ scripts).

    from through_controller import run_through_controller
    metrics, wall_seconds = run_through_controller(run, work_dir)   # metrics: {step: {name: value}}

    with controller_running(run, work_dir) as store: ...            # to watch (or hurt) the run meanwhile

The run goes into a fresh SQLite store under `work/mortal-home`, a `python -m mortal.controller`
subprocess (log: work/controller.log) trains it to the end, and the store's metrics come back by
step. A run that does not succeed stops the benchmark with its status. A bench cut short (SIGTERM from
`timeout` or the device's limit, an error) deletes the unfinished run, so the controller stops its
workers before it is terminated itself: nothing is left running on the GPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def exit_on_sigterm() -> None:
    """Make SIGTERM end this bench as SystemExit (exit status 143), so its `finally` blocks run.

    Why: `timeout` and the device's per-call limit end a bench with SIGTERM, which by default ends Python
    at once: the controller subprocess and its workers would be left running on the GPU, and what the
    bench had measured so far would be lost with it. Call it from the main thread."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


@contextlib.contextmanager
def controller_running(run: Any, work: Path) -> Iterator[Any]:
    """The run applied to a fresh SQLite store under `work/mortal-home` and a controller subprocess
    reconciling it (log: work/controller.log) while the block runs; yields the store."""
    from mortal.client.apply import fit_micro_batches, refuse_what_cannot_fit
    from mortal.client.errors import ClientError as CliError
    from mortal.state import open_store

    try:  # what `mortalctl apply` refuses, refused before the device's minutes go on it
        refuse_what_cannot_fit([run])
    except CliError as exc:
        raise SystemExit(f"mortal run {run.name} not started: {exc}") from exc
    run = fit_micro_batches([run])[0]  # as `mortalctl apply` does: a micro batch estimated to fit, if needed
    home = work / "mortal-home"
    url = f"sqlite:///{home / 'state.db'}"
    store = open_store(url)
    store.apply_run(run.name, run.spec_dict(), run.metadata.labels, run.metadata.annotations)
    env = {**os.environ, "MORTAL_HOME": str(home), "MORTAL_STATE_URL": url, "WANDB_MODE": "disabled"}
    if threading.current_thread() is threading.main_thread():
        exit_on_sigterm()  # a time limit ends the block through its finally, which stops the workers
    with open(work / "controller.log", "w") as log:
        # A session of its own: `timeout` signals its whole process group, and the controller must outlive
        # the bench's SIGTERM long enough to stop the workers (stop_workers) before it is terminated.
        controller = subprocess.Popen(
            [sys.executable, "-m", "mortal.controller"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield store
        finally:
            if store.get_run(run.name).phase not in ("Succeeded", "Failed"):
                stop_workers(store, run.name)
            controller.terminate()
            try:
                controller.wait(60)
            except subprocess.TimeoutExpired:  # a controller too busy to stop in time is not left behind
                controller.kill()
                controller.wait()


def task_timeline(work: Path, name: str, steps: list[int]) -> dict[int, list[dict[str, float]]]:
    """Each step's rollout tasks as the store recorded them, by slot: when queued and done (epoch seconds),
    and what the task's results say its rollout spent generating, scoring and loading weights. What a
    task took beyond those is the way to it and back (the lease, the hand-in, the polls on both sides)."""
    from mortal.state import open_store

    store = open_store(f"sqlite:///{work / 'mortal-home' / 'state.db'}")
    try:
        timeline = {}
        for step in steps:
            timeline[step] = []
            for row in store.step_results(name, step):
                results = (row.result or {}).get("results", [])
                timeline[step].append(
                    {
                        "queued": row.created_at.timestamp(),
                        "done": row.done_at.timestamp() if row.done_at else None,
                        "generate": sum(r.get("generation_seconds", 0.0) for r in results),
                        "reward": sum(r.get("reward_seconds", 0.0) for r in results),
                        "load": max((r.get("weight_load_seconds", 0.0) for r in results), default=0.0),
                    }
                )
        return timeline
    finally:
        store.close()


MEMORY_EVENTS = (
    "MicroBatchReduced",
    "RolloutShareReduced",
    "OutOfMemory",
)  # mortal.controller.heal's, MemoryFits'


def memory_record(work: Path, name: str) -> dict[str, Any]:
    """What the controller chose for the run's memory (status.effective: the micro batch the actor trained
    with, a lowered rollout share) and its memory events (a micro batch chosen before launch, each
    out-of-memory and its heal), read from the run's store after it ended; {} when the store is not there."""
    from mortal.state import NotFound, open_store

    path = work / "mortal-home" / "state.db"
    if not path.exists():
        return {}
    store = open_store(f"sqlite:///{path}")
    try:
        row = store.get_run(name)
        events = [
            {"type": e.type, "reason": e.reason, "message": e.message}
            for e in store.list_events(name, limit=1000)
            if e.reason in MEMORY_EVENTS
        ]
        algorithm = row.spec.get("algorithm") or {}
        effective = (row.status or {}).get("effective") or {}
        spec_micro = algorithm.get("microBatchSize") or algorithm.get("batchSize")
        return {
            "micro_batch": effective.get("microBatchSize") or spec_micro,
            "spec_micro_batch": spec_micro,
            "chosen_by_controller": "microBatchSize" in effective,
            "effective": effective,
            "restarts": (row.status or {}).get("restarts"),
            "events": events,
        }
    except NotFound:
        return {}
    finally:
        store.close()


def compile_scopes() -> tuple[str, ...]:
    """generation.compileScope's choices as the spec declares them, so a bench offers what a spec accepts."""
    from typing import get_args

    from mortal.specs.training import GenerationSpec

    return get_args(GenerationSpec.model_fields["compile_scope"].annotation)


def local_gpu() -> str:
    """This machine's GPU as a spec names it (actor.gpu, rollout.gpu): H100, H200, ..., so that the memory
    check above holds it to its own size; the driver's name, spaces dashed, for a card the table lacks."""
    import torch

    from mortal.controller.backends.gpus import spec_name_of

    device_name = torch.cuda.get_device_name(0)
    return spec_name_of(device_name) or device_name.replace(" ", "-")


def stop_workers(store: Any, name: str, seconds: float = 60.0) -> None:
    """Delete a run the bench is leaving unfinished (a time limit, an error) and wait until the controller
    has stopped its workers: a controller that is terminated leaves its workers running (a new one adopts
    them), and nothing would adopt these. Waits `seconds` at most."""
    from mortal.state import NotFound

    store.mark_deleted(name, purge=False)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not store.list_workers(name, live_only=True):
                return
        except NotFound:
            return
        time.sleep(0.5)


def copy_logs(work: Path, dest: Path) -> None:
    """The controller's log and every worker's (work/controller.log, work/mortal-home/runs/*/logs/) into
    `dest`: start-up and compile lines, and why a run cut short had not finished, outlive `work`; with them
    the actor's step profiles (mortal.workers.actor.step_profile), where a run made them."""
    dest.mkdir(parents=True, exist_ok=True)
    for log in [
        work / "controller.log",
        *work.glob("mortal-home/runs/*/logs/*.log"),
        *work.glob("mortal-home/runs/*/logs/profile-*"),
    ]:
        if log.exists():
            shutil.copy(log, dest / log.name)


def run_through_controller(
    run: Any, work: Path, poll_seconds: float = 1.0
) -> tuple[dict[int, dict[str, float]], float]:
    home = work / "mortal-home"
    started = time.time()
    with controller_running(run, work) as store:
        while (phase := store.get_run(run.name).phase) not in ("Succeeded", "Failed"):
            time.sleep(poll_seconds)
    wall = time.time() - started
    if phase != "Succeeded":
        raise SystemExit(
            f"mortal run {run.name} ended {phase}: {store.get_run(run.name).status} (see {home})"
        )
    by_step: dict[int, dict[str, float]] = {}
    for metric in store.list_metrics(run.name):
        by_step.setdefault(metric.step, {})[metric.name] = metric.value
        if metric.name == "step_seconds":  # when the step ended (UTC epoch seconds), for time windows
            by_step[metric.step]["ended_at"] = metric.time.timestamp()
    store.close()
    return by_step, wall
