"""Test helper: real worker processes of the simulated workload, launched by the local backend.

Imported by tests/workers/test_runtime.py and test_simulated.py (same folder, pytest's rootdir
import). It plays the controller's part by hand: record the worker row, launch, record the handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from polling import wait_for

from mortal.controller.backends import BackendWorker, WorkerLaunch
from mortal.controller.backends.local import LocalBackend
from mortal.specs import TrainingRun
from mortal.state import Store, WorkerRef, WorkerRow, open_store
from mortal.state.auth import launch_token


@dataclass
class Started:
    row: WorkerRow
    ref: WorkerRef
    handle: str


class SimCluster:
    """A store, a local backend, and the workers a test started (all stopped by close())."""

    def __init__(self, store_url: str, home: Path) -> None:
        self.url, self.home = store_url, home
        self.store: Store = open_store(store_url)
        self.backend = LocalBackend(home)
        self.handles: list[str] = []

    def apply(self, run: TrainingRun) -> TrainingRun:
        self.store.apply_run(run.name, run.spec_dict(), annotations=run.metadata.annotations)
        return run

    def start(
        self,
        run: str,
        role: str,
        replica: int = 0,
        lease_seconds: float = 5.0,
        heartbeat_seconds: float = 0.2,
    ) -> Started:
        row = self.store.create_worker(run, role, replica, "local", lease_seconds)
        ref = WorkerRef(run, role, replica, row.incarnation)
        handle = self.backend.launch(
            WorkerLaunch(
                run=run,
                role=role,
                replica=replica,
                incarnation=row.incarnation,
                worker_id=ref.id,
                state_url=self.url,
                mortal_home=str(self.home),
                heartbeat_seconds=heartbeat_seconds,
                state_token=launch_token(
                    self.url, ref
                ),  # what the controller gives a worker of an HTTP store
            )
        )
        self.store.set_worker_handle(row.id, handle)
        self.handles.append(handle)
        return Started(row, ref, handle)

    def row(self, started: Started) -> WorkerRow:
        return next(w for w in self.store.list_workers(started.ref.run) if w.id == started.row.id)

    def listed(self, started: Started) -> BackendWorker | None:
        return next((w for w in self.backend.list(started.ref.run) if w.handle == started.handle), None)

    def wait_exit(self, started: Started, timeout: float = 30.0) -> int | None:
        """The worker's exit code, once it has exited."""

        def exited() -> BackendWorker | None:
            worker = self.listed(started)
            return worker if worker is not None and not worker.alive else None

        return wait_for(exited, timeout, f"{started.ref.id} to exit").exit_code

    def wait_step(self, started: Started, step: int, timeout: float = 30.0) -> None:
        wait_for(lambda: (self.row(started).step or 0) >= step, timeout, f"{started.ref.id} at step {step}")

    def close(self) -> None:
        for handle in self.handles:
            self.backend.stop(handle, grace_seconds=2.0)
        self.store.close()
