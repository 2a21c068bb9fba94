"""Run one TrainingRun through a real controller and read back its per-step metrics (for bench/ scripts).

    from through_controller import run_through_controller
    metrics, wall_seconds = run_through_controller(run, work_dir)   # metrics: {step: {name: value}}

    with controller_running(run, work_dir) as store: ...            # to watch (or hurt) the run meanwhile

The run goes into a fresh SQLite store under `work/mortal-home`, a `python -m mortal.controller`
subprocess (log: work/controller.log) trains it to the end, and the store's metrics come back by
step. A run that does not succeed stops the benchmark with its status.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def controller_running(run: Any, work: Path) -> Iterator[Any]:
    """The run applied to a fresh SQLite store under `work/mortal-home` and a controller subprocess
    reconciling it (log: work/controller.log) while the block runs; yields the store."""
    from mortal.state import open_store

    home = work / "mortal-home"
    url = f"sqlite:///{home / 'state.db'}"
    store = open_store(url)
    store.apply_run(run.name, run.spec_dict(), run.metadata.labels, run.metadata.annotations)
    env = {**os.environ, "MORTAL_HOME": str(home), "MORTAL_STATE_URL": url, "WANDB_MODE": "disabled"}
    with open(work / "controller.log", "w") as log:
        controller = subprocess.Popen([sys.executable, "-m", "mortal.controller"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
        try:
            yield store
        finally:
            controller.terminate()
            controller.wait(60)


def run_through_controller(run: Any, work: Path, poll_seconds: float = 1.0) -> tuple[dict[int, dict[str, float]], float]:
    home = work / "mortal-home"
    started = time.time()
    with controller_running(run, work) as store:
        while (phase := store.get_run(run.name).phase) not in ("Succeeded", "Failed"):
            time.sleep(poll_seconds)
    wall = time.time() - started
    if phase != "Succeeded":
        raise SystemExit(f"mortal run {run.name} ended {phase}: {store.get_run(run.name).status} (see {home})")
    by_step: dict[int, dict[str, float]] = {}
    for metric in store.list_metrics(run.name):
        by_step.setdefault(metric.step, {})[metric.name] = metric.value
        if metric.name == "step_seconds":  # when the step ended (UTC epoch seconds), for time windows
            by_step[metric.step]["ended_at"] = metric.time.timestamp()
    store.close()
    return by_step, wall
