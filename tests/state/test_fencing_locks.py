"""A takeover waits for the old incarnation's writes in flight: none of them lands after the new one exists.

The fence check of a worker's write and the write share a transaction, and the check keeps the worker's
row locked until commit (PostgreSQL: FOR SHARE, FOR UPDATE for writes of the worker row itself; SQLite:
the one writer). create_worker locks the same row before it adds the next incarnation. Shown by holding
a worker's write between its check and its write, and timing a takeover of its slot started meanwhile:
two store objects, as the controller and a worker are two processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event

from mortal.state import Fenced, NewTask, WorkerRef, open_store
from mortal.state.sql_store import SqlStore

SPEC = {"model": {"name": "tiny"}}
WAIT = 1.0  # seconds the takeover is given to (wrongly) finish while the write is held


@pytest.fixture
def stores(sql_store_url: str) -> Iterator[tuple[SqlStore, SqlStore]]:
    worker_side, controller_side = open_store(sql_store_url), open_store(sql_store_url)
    try:
        yield worker_side, controller_side  # type: ignore[misc]
    finally:
        worker_side.close()
        controller_side.close()


def _held_before(store: SqlStore, statement_start: str) -> tuple[threading.Event, threading.Event]:
    """Hold the store's next statement that starts with `statement_start` until `release` is set;
    `reached` is set when it gets there (its fence check already made, in the same transaction)."""
    reached, release = threading.Event(), threading.Event()

    def hold(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.lstrip().startswith(statement_start) and not reached.is_set():
            reached.set()
            assert release.wait(60)

    event.listen(store._engine, "before_cursor_execute", hold)
    return reached, release


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def _setup(store: SqlStore) -> tuple[WorkerRef, int, int]:
    store.apply_run("r", SPEC)
    actor = WorkerRef("r", "actor", 0, store.create_worker("r", "actor", 0, "local", 60).incarnation)
    store.enqueue_tasks(actor, [NewTask(step=1, slot=0, min_weight_version=0)])
    rollout = WorkerRef("r", "rollout", 0, store.create_worker("r", "rollout", 0, "local", 60).incarnation)
    task = store.lease_task(rollout, 60)
    assert task is not None
    return rollout, task.id, task.lease_token


@pytest.mark.parametrize(
    "write, held_at",
    [
        (lambda s, ref, task, token: s.complete_task(ref, task, token, {"reward": 1.0}), "UPDATE tasks"),
        (lambda s, ref, task, token: s.renew_task(ref, task, token, 60), "UPDATE tasks"),
        (lambda s, ref, task, token: s.heartbeat(ref, step=2), "UPDATE workers"),
        (lambda s, ref, task, token: s.add_metrics(ref, 1, {"loss": 0.5}), "INSERT INTO metrics"),
    ],
    ids=["complete_task", "renew_task", "heartbeat", "add_metrics"],
)
def test_a_takeover_waits_for_the_old_incarnations_write_in_flight(stores, write, held_at) -> None:
    worker_side, controller_side = stores
    ref, task_id, token = _setup(controller_side)
    reached, release = _held_before(worker_side, held_at)
    writing, written = _in_thread(lambda: write(worker_side, ref, task_id, token))
    assert reached.wait(30), "the write reached its statement"
    taking_over, taken = _in_thread(lambda: controller_side.create_worker("r", "rollout", 0, "local", 60))
    taking_over.join(WAIT)
    finished_first = taking_over.is_alive() is False
    release.set()
    writing.join(30)
    taking_over.join(30)
    assert not finished_first, "the new incarnation existed while the old one's write was still to land"
    assert written and written[0] is not False and taken[0].incarnation > ref.incarnation
    with pytest.raises(Fenced):
        write(worker_side, ref, task_id, token)


def test_a_lease_of_an_ended_worker_is_refused_and_takes_no_task(stores) -> None:
    worker_side, controller_side = stores
    ref, _, _ = _setup(controller_side)
    actor = WorkerRef("r", "actor", 0, 1)
    controller_side.enqueue_tasks(actor, [NewTask(step=1, slot=1, min_weight_version=0)])
    controller_side.create_worker("r", "rollout", 0, "local", 60)  # a takeover: ref is no longer the newest
    with pytest.raises(Fenced):
        worker_side.lease_task(ref, 60)
    assert controller_side.step_states("r", 1) == ["leased", "queued"], "the refused lease took nothing"
