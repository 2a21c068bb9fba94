"""Helpers the mortalctl tests import (a uniquely named module: `conftest` is taken by tests/conftest.py)."""

from __future__ import annotations

from typing import Any

from mortal.specs import EXAMPLES_DIR
from mortal.state import Store, WorkerRef

QUICKSTART = EXAMPLES_DIR / "quickstart.yaml"


def actor(store: Store, run: str) -> WorkerRef:
    """Record a live actor worker of `run` and return its ref (to write checkpoints and metrics as it)."""
    row = store.create_worker(run, "actor", 0, "local", lease_seconds=30)
    store.set_worker_handle(row.id, "4242:1795315222.5")
    ref = WorkerRef(run, "actor", 0, row.incarnation)
    store.heartbeat(ref, step=0, weight_version=0)
    return ref


def set_status(store: Store, run: str, **fields: Any) -> None:
    """Write a status block (camelCase keys) over the run's current one, as the controller would."""
    row = store.get_run(run)
    store.write_status(run, {**row.status, **fields})
