"""fork_run and rollback_run of the Store contract, against every backend (`store`:
SQLite, PostgreSQL, HTTP)."""

from __future__ import annotations

import pytest

from mortal.state import Conflict, NewTask, NotFound, Store, WorkerRef

SPEC = {"model": {"name": "m"}}


def _actor(store: Store, run: str) -> WorkerRef:
    row = store.create_worker(run, "actor", 0, "local", lease_seconds=30)
    return WorkerRef(run, "actor", 0, row.incarnation)


def test_fork_run_creates_the_run_with_its_lineage_and_starting_checkpoint(store: Store) -> None:
    row = store.fork_run("child", SPEC, {"team": "rl"}, {"note": "x"}, "parent", 20, "/ckpt/step-20", 7)
    assert (row.forked_from, row.forked_from_step, row.labels, row.annotations) == (
        "parent",
        20,
        {"team": "rl"},
        {"note": "x"},
    )
    assert store.get_run("child").forked_from == "parent"
    [ckpt] = store.list_checkpoints("child")
    assert (ckpt.step, ckpt.path, ckpt.weight_version, ckpt.complete) == (20, "/ckpt/step-20", 7, True)
    with pytest.raises(Conflict, match="already exists"):
        store.fork_run("child", SPEC, {}, {}, "parent", 10, "/ckpt/step-10", 3)
    assert [c.step for c in store.list_checkpoints("child")] == [20]
    store.apply_run("plain", SPEC)
    assert store.get_run("plain").forked_from is None


def test_rollback_run_forgets_later_steps_and_refuses_while_workers_live(store: Store) -> None:
    store.apply_run("r", SPEC)
    actor = _actor(store, "r")
    for step in (2, 4, 6):
        store.record_checkpoint(actor, step, f"/ckpt/step-{step}", step)
    for step in range(1, 7):
        store.add_metrics(actor, step, {"loss": float(step)})
    store.enqueue_tasks(actor, [NewTask(step, 0, 0) for step in (5, 6, 7)])
    store.heartbeat(actor, step=6)
    with pytest.raises(Conflict, match="live workers"):
        store.rollback_run("r", 4)
    [row] = store.list_workers("r")
    store.end_worker(row.id, "Stopped")
    with pytest.raises(NotFound, match="step 3"):
        store.rollback_run("r", 3)
    later = store.rollback_run("r", 2)
    assert [(c.step, c.path) for c in later] == [(4, "/ckpt/step-4"), (6, "/ckpt/step-6")]
    assert [c.step for c in store.list_checkpoints("r")] == [2]
    assert store.latest_checkpoint("r").step == 2
    assert sorted({m.step for m in store.list_metrics("r")}) == [1, 2]
    assert store.step_results("r", 5) == [] and store.step_results("r", 7) == []
    assert [w.step for w in store.list_workers("r")] == [2]
    with pytest.raises(NotFound):
        store.rollback_run("nope", 2)
