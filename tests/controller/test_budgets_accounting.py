"""GPU time through the reconciler and the store: each worker row records the GPUs its backend gives it
(`Backend.gpus_held`), so GPU-hours are rebuilt from the store by any controller, a restarted one too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from realproc import FAST

from mortal.controller import budgets
from mortal.controller.backends.base import Backend, BackendWorker, WorkerLaunch
from mortal.controller.leader import LeaderElector
from mortal.controller.reconciler import Reconciler
from mortal.workers.simulated import simulated_run


class GPUBackend(Backend):
    """An in-memory backend that lists each worker it launched as alive (the base class's gpus_held)."""

    name = "local"

    def __init__(self) -> None:
        self.workers: dict[str, BackendWorker] = {}
        self.launched: list[WorkerLaunch] = []

    def launch(self, launch: WorkerLaunch) -> str:
        handle = f"mem:{launch.worker_id}"
        self.launched.append(launch)
        self.workers[handle] = BackendWorker(
            launch.worker_id, handle, launch.run, launch.role, launch.replica, launch.incarnation, alive=True
        )
        return handle

    def list(self, run=None):
        return [w for w in self.workers.values() if run is None or w.run == run]

    def stop(self, handle, grace_seconds=5.0):
        self.workers.pop(handle, None)


def reconciler(store, store_url, backend):
    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    return Reconciler(store, store_url, elector, FAST, backends=lambda _: backend)


@pytest.mark.parametrize(
    ("actor", "rollout", "expected"),
    [
        ({"gpu": "H100"}, {"gpu": "H100", "replicas": 2}, [("actor", 1), ("rollout", 1), ("rollout", 1)]),
        (
            {"gpu": "H100"},
            {"gpu": "H100", "replicas": 2, "colocate": True},
            [("actor", 1), ("rollout", 0), ("rollout", 0)],
        ),
        ({"gpu": "none"}, {"gpu": "none", "replicas": 2}, [("actor", 0), ("rollout", 0), ("rollout", 0)]),
    ],
)
def test_each_worker_row_records_the_gpus_its_backend_gives_it(
    store, store_url, mortal_home: Path, actor, rollout, expected
):
    backend = GPUBackend()
    run = simulated_run(
        "g",
        spec={
            "actor": actor,
            "rollout": rollout,
            "generation": {"engine": "transformers"},
            "limits": {"maxGPUHours": 1},
        },
    )
    store.apply_run(run.name, run.spec_dict())
    reconciler(store, store_url, backend).reconcile("g")
    rows = store.list_workers("g")
    assert sorted((w.role, w.gpus) for w in rows) == expected
    status = store.get_run("g").status
    assert status["gpuHours"] == 0.0  # launched a moment ago

    # an hour later, by the rows alone (what a restarted controller reads): wall time x GPUs of each worker
    later = datetime.now(UTC) + timedelta(hours=1)
    held = sum(gpus for _, gpus in expected)
    assert budgets.gpu_seconds(store.list_workers("g"), later) == pytest.approx(held * 3600, rel=1e-3)
