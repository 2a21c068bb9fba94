"""Helpers the mortalctl tests import (a uniquely named module: `conftest` is taken by tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mortal.specs import EXAMPLES_DIR
from mortal.state import Store, WorkerRef

QUICKSTART = EXAMPLES_DIR / "quickstart.yaml"
DROP = object()  # spec_file(**{"spec.rollout.replicas": DROP}): the file leaves that field out
CHECKPOINT_FILES = (
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "trainer_state.json",
)


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


def checkpoint_in(folder: Path, step: int, run: str = "quickstart") -> Path:
    """A complete checkpoint of `run` at `step` in `folder` (its files, and mortal.json saying whose it
    is)."""
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        (folder / name).write_bytes(bytes([step]) * 100)
    (folder / "mortal.json").write_text(
        json.dumps({"run": run, "step": step, "weight_version": step, "seed": 0})
    )
    return folder
