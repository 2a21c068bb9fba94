"""Helpers of the real-process controller tests: simulated runs, a controller, process scans, waits.

    from realproc import harness  # the fixture (store_url x mortal_home), imported into the test module
    h.apply(simulated_run("r", max_steps=20)); h.start(); h.wait_phase("r", "Running")

Every test that uses `harness` ends with no worker process of its MORTAL_HOME alive: the fixture
fails the test if any was left (then kills them, so one leak does not spread to the next test).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from polling import wait_for

from mortal.client.cli.context import modify_spec
from mortal.controller import wake
from mortal.controller.manager import Controller
from mortal.controller.observed import PlanConfig
from mortal.controller.reconciler import ControllerConfig
from mortal.specs import TrainingRun
from mortal.state import RunRow, Store, open_store, paths

FAST = ControllerConfig(
    plan=PlanConfig(
        launch_grace_seconds=3.0,
        active_resync_seconds=0.5,
        stop_grace_seconds=5.0,
        orphan_grace_seconds=1.0,
        stop_poll_seconds=0.3,
        backoff_reset_seconds=60.0,
    ),
    worker_lease_seconds=5.0,
    leader_lease_seconds=3.0,
    leader_renew_seconds=0.5,
    poll_seconds=0.25,
    resync_seconds=5.0,
    retry_base_seconds=0.2,
    retry_max_seconds=5.0,
)


def worker_processes(home: Path, role: str | None = None, run: str | None = None) -> list[psutil.Process]:
    """Live worker leader processes of this MORTAL_HOME (found by MORTAL_WORKER_ID, as the backend does)."""
    found = []
    for proc in psutil.process_iter(["environ", "status"]):
        env = proc.info.get("environ") or {}
        if "MORTAL_WORKER_ID" not in env or os.path.realpath(env.get("MORTAL_HOME", "")) != os.path.realpath(
            home
        ):
            continue
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if (role is None or env.get("MORTAL_ROLE") == role) and (run is None or env.get("MORTAL_RUN") == run):
            found.append(proc)
    return found


def worker_ids(home: Path, role: str | None = None) -> list[str]:
    out = []
    for proc in worker_processes(home, role):
        try:
            out.append(proc.environ()["MORTAL_WORKER_ID"])
        except psutil.Error:
            continue
    return sorted(out)


def kill_all(home: Path) -> None:
    for proc in worker_processes(home):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    psutil.wait_procs(worker_processes(home), timeout=5)


class Harness:
    """A store, the test's MORTAL_HOME, and controllers started in threads or subprocesses."""

    def __init__(self, url: str, home: Path):
        self.url, self.home = url, home
        self.store: Store = open_store(url)
        self.controllers: list[Controller] = []
        self.subprocesses: list[subprocess.Popen[bytes]] = []

    def apply(self, run: TrainingRun) -> RunRow:
        row, _ = self.store.apply_run(
            run.name, run.spec_dict(), labels=run.metadata.labels, annotations=run.metadata.annotations
        )
        wake.notify(run.name)
        return row

    def change_spec(self, name: str, change: Callable[[dict[str, Any]], None]) -> RunRow:
        """What `mortalctl scale/suspend/resume` do, through their own modify_spec: compare-and-swap of the
        spec, read again and retried when a status write of the running controller came in between, then a
        wake."""

        def changed(row: RunRow) -> dict[str, Any]:
            spec = dict(row.spec)
            change(spec)
            return spec

        _, row = modify_spec(self.store, name, changed)
        wake.notify(name)
        return row

    def start(self, config: ControllerConfig = FAST) -> Controller:
        controller = Controller(self.store, self.url, config).start()
        self.controllers.append(controller)
        return controller

    def spawn(
        self, *args: str, env: dict[str, str] | None = None, log: str = "controller"
    ) -> subprocess.Popen[bytes]:
        """`python -m mortal.controller` in a subprocess of its own process group, logging to a file."""
        out = open(self.home / f"{log}.log", "ab")  # noqa: SIM115 - handed to the child, closed with it
        child_env = {**os.environ, "MORTAL_HOME": str(self.home), "MORTAL_STATE_URL": self.url, **(env or {})}
        proc = subprocess.Popen(
            [sys.executable, "-m", "mortal.controller", *args],
            env=child_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.subprocesses.append(proc)
        return proc

    def status(self, name: str) -> dict[str, Any]:
        return self.store.get_run(name).status

    def wait_phase(self, name: str, phase: str, timeout: float = 30.0) -> dict[str, Any]:
        return wait_for(
            lambda: (s := self.status(name)).get("phase") == phase and s, timeout, f"{name} {phase}"
        )

    def live_rows(self, name: str, role: str | None = None) -> list:
        return [w for w in self.store.list_workers(name, live_only=True) if role is None or w.role == role]

    def resumed_from(self, name: str, incarnation: int) -> int | None:
        """The checkpoint step the actor of `incarnation` says it resumed from (its log), None if fresh."""
        log = paths.worker_log(name, "actor", 0, incarnation)
        found = (
            re.search(r"resuming from checkpoint of step (\d+)", log.read_text()) if log.exists() else None
        )
        return int(found.group(1)) if found else None

    def close(self) -> None:
        for controller in self.controllers:
            controller.stop()
        for proc in self.subprocesses:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.store.close()


@pytest.fixture
def harness(store_url: str, mortal_home: Path) -> Iterator[Harness]:
    h = Harness(store_url, mortal_home)
    try:
        yield h
    finally:
        h.close()
        left = worker_ids(mortal_home)
        kill_all(mortal_home)
    assert left == [], f"worker processes left behind: {left}"


def wait_no_workers(h: Harness, timeout: float = 20.0, run: str | None = None) -> None:
    wait_for(
        lambda: not worker_processes(h.home, run=run),
        timeout,
        f"every worker process of {run or 'all'} to exit",
    )


def delete_and_wait(h: Harness, name: str, purge: bool = False, timeout: float = 30.0) -> None:
    """`mortalctl delete`: mark, wake, wait until the controller purged the row and no process is left."""
    h.store.mark_deleted(name, purge=purge)
    wake.notify(name)
    wait_for(lambda: name not in {r.name for r in h.store.list_runs()}, timeout, f"{name} purged")
    wait_no_workers(h, run=name)
