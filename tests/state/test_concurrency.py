"""Real concurrent processes against one store (SQLite file and PostgreSQL database).

Each child opens its own store (spawned, not forked: no shared connections), waits on a barrier so
they start together, and reports back through a queue. Checked: read-modify-write with retries on
Conflict never loses an update; concurrent task leasing never hands one task to two workers;
concurrent worker creation never reuses an incarnation.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from mortal.state import Conflict, NewTask, Store, WorkerRef, open_store

SPEC = {"model": {"name": "tiny"}, "rollout": {"replicas": 1}, "counters": {"edit": 0}}
ROUNDS = 12


def _in_children(target: Callable[..., Any], arg_lists: list[tuple]) -> list[Any]:
    """Run target(barrier, *args) in one spawned process per arg tuple; return their results."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(arg_lists)), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, results, barrier, *args)) for args in arg_lists]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            ok, value = results.get(timeout=240)
            assert ok, f"a child failed:\n{value}"
            out.append(value)
    except queue_mod.Empty:
        pytest.fail("a child process hung")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


def _child(target: Callable[..., Any], results: Any, barrier: Any, *args: Any) -> None:
    import traceback

    try:
        results.put((True, target(barrier, *args)))
    except BaseException:
        results.put((False, traceback.format_exc()))


# -- children (module-level so spawn can import them) ----------------------------------------------
def _retry(write: Callable[[], Any]) -> int:
    """Run a read-modify-write until it lands; returns how many Conflicts it met."""
    conflicts = 0
    while True:
        try:
            write()
            return conflicts
        except Conflict:
            conflicts += 1


def _rmw_child(barrier: Any, url: str, what: str) -> int:
    store = open_store(url)
    barrier.wait()
    conflicts = 0
    for _ in range(ROUNDS):

        def write() -> None:
            row = store.get_run("r")
            if what == "status":
                status = {**row.status, "n": row.status.get("n", 0) + 1, "phase": "Running"}
                store.write_status("r", status, resource_version=row.resource_version)
                return
            spec = dict(row.spec)
            if what == "scale":
                spec["rollout"] = {**spec["rollout"], "replicas": spec["rollout"]["replicas"] + 1}
            else:
                spec["counters"] = {**spec["counters"], "edit": spec["counters"]["edit"] + 1}
            store.update_spec("r", spec, resource_version=row.resource_version)

        conflicts += _retry(write)
    store.close()
    return conflicts


def _lease_child(barrier: Any, url: str, ref: WorkerRef) -> list[int]:
    store = open_store(url)
    barrier.wait()
    got = []
    while (task := store.lease_task(ref, lease_seconds=120)) is not None:
        got.append(task.id)
        assert store.complete_task(ref, task.id, task.lease_token, {"by": ref.id})
    store.close()
    return got


def _create_workers_child(barrier: Any, url: str, role: str) -> list[int]:
    store = open_store(url)
    barrier.wait()
    made = [store.create_worker("r", role, i, "local", 10).incarnation for i in range(8)]
    store.close()
    return made


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_read_modify_write_never_loses_an_update(store: Store, store_url: str) -> None:
    store.apply_run("r", SPEC)
    _in_children(_rmw_child, [(store_url, "scale"), (store_url, "edit"), (store_url, "status")])
    row = store.get_run("r")
    assert row.spec["rollout"]["replicas"] == 1 + ROUNDS
    assert row.spec["counters"]["edit"] == ROUNDS
    assert row.status["n"] == ROUNDS
    assert (row.generation, row.resource_version) == (1 + 2 * ROUNDS, 1 + 3 * ROUNDS)


@pytest.mark.timeout(300)
def test_concurrent_leasing_hands_out_each_task_once(store: Store, store_url: str) -> None:
    store.apply_run("r", SPEC)
    actor = store.create_worker("r", "actor", 0, "local", 10)
    actor_ref = WorkerRef("r", "actor", 0, actor.incarnation)
    tasks = [NewTask(step=s, slot=k, min_weight_version=0) for s in range(4) for k in range(12)]
    assert store.enqueue_tasks(actor_ref, tasks) == len(tasks)
    refs = []
    for replica in range(4):
        row = store.create_worker("r", "rollout", replica, "local", 10)
        refs.append(WorkerRef("r", "rollout", replica, row.incarnation))

    leased = _in_children(_lease_child, [(store_url, ref) for ref in refs])
    every = [task_id for got in leased for task_id in got]
    assert not [t for t, n in Counter(every).items() if n > 1], "a task was leased twice"
    done = [t for step in range(4) for t in store.step_results("r", step)]
    assert sorted(every) == sorted(t.id for t in done)
    assert all(t.state == "done" and t.attempts == 1 for t in done)


@pytest.mark.timeout(300)
def test_concurrent_worker_creation_never_reuses_an_incarnation(store: Store, store_url: str) -> None:
    store.apply_run("r", SPEC)
    made = _in_children(_create_workers_child, [(store_url, "actor"), (store_url, "rollout")])
    every = sorted(made[0] + made[1])
    assert every == list(range(1, 17))
