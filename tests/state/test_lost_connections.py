"""A database connection that breaks under the store: a call is made again only when nothing was committed.

PostgreSQL only (a SQLite connection is a file, not a server's session). The store sends no ping before
each call (mortal.state.engine): a pooled connection the server closed is dropped at checkout, one that
breaks inside a transaction before its COMMIT makes the call again once (ConnectionLost), and one that
breaks during COMMIT raises Unavailable, since nobody can tell whether the write was applied.
Connections are broken the way an operator or a server restart does: pg_terminate_backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import event

from mortal.state import NewTask, WorkerRef, open_store
from mortal.state.errors import ConnectionLost, Unavailable
from mortal.state.sql_store import SqlStore

pytestmark = pytest.mark.postgres
SPEC = {"model": {"name": "tiny"}}


@pytest.fixture
def store(pg_database: str) -> Iterator[SqlStore]:
    opened = open_store(pg_database)
    assert isinstance(opened, SqlStore)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def admin(pg_database: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(pg_database, autocommit=True) as conn:
        yield conn


def _terminate(admin: psycopg.Connection, pids: list[int]) -> None:
    """End these backends as an operator would, and wait until they are gone."""
    for pid in pids:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 30
    while admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone()[0]:
        assert time.monotonic() < deadline, f"backends {pids} did not end"
        time.sleep(0.05)


def _store_backends(admin: psycopg.Connection) -> list[int]:
    query = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    return [pid for (pid,) in admin.execute(query).fetchall()]


def _errors_seen(store: SqlStore) -> list[BaseException]:
    """Every DBAPI error the store's engine meets from now on."""
    seen: list[BaseException] = []
    event.listen(store._engine, "handle_error", lambda context: seen.append(context.original_exception))
    return seen


def _worker_with_a_task(store: SqlStore) -> tuple[WorkerRef, int, int]:
    store.apply_run("r", SPEC)
    actor = WorkerRef("r", "actor", 0, store.create_worker("r", "actor", 0, "local", 60).incarnation)
    store.enqueue_tasks(actor, [NewTask(step=1, slot=0, min_weight_version=0)])
    rollout = WorkerRef("r", "rollout", 0, store.create_worker("r", "rollout", 0, "local", 60).incarnation)
    task = store.lease_task(rollout, 60)
    assert task is not None
    return rollout, task.id, task.lease_token


def test_a_pooled_connection_the_server_closed_is_replaced_before_any_statement(store: SqlStore, admin):
    ref, _, _ = _worker_with_a_task(store)
    backends = _store_backends(admin)
    assert backends, "the store keeps its connection pooled"
    _terminate(admin, backends)
    seen = _errors_seen(store)
    assert store.heartbeat(ref, step=3).step == 3
    assert seen == [], "the dead connection was dropped at checkout, not found out by a failing statement"
    assert set(_store_backends(admin)).isdisjoint(backends)


def test_a_call_whose_connection_breaks_before_commit_is_made_again_once(store: SqlStore, admin) -> None:
    ref, task_id, token = _worker_with_a_task(store)
    seen, begun = _errors_seen(store), []

    @event.listens_for(store._engine, "begin")
    def _break_the_first(conn) -> None:  # after the checkout check: the first statement meets a dead session
        begun.append(conn)
        if len(begun) == 1:
            _terminate(admin, [conn.connection.dbapi_connection.info.backend_pid])

    assert store.complete_task(ref, task_id, token, {"reward": 1.0})
    assert len(begun) == 2 and len(seen) == 1, "one broken attempt, one that went through"
    assert store.step_states("r", 1) == ["done"]


def test_a_second_break_is_raised(store: SqlStore, admin) -> None:
    ref, task_id, token = _worker_with_a_task(store)

    @event.listens_for(store._engine, "begin")
    def _break_every(conn) -> None:
        _terminate(admin, [conn.connection.dbapi_connection.info.backend_pid])

    with pytest.raises(ConnectionLost):
        store.renew_task(ref, task_id, token, 60)
    event.remove(store._engine, "begin", _break_every)
    assert store.renew_task(ref, task_id, token, 60), "the lease is still held: nothing was applied"


def test_a_connection_that_breaks_during_commit_is_not_made_again(store: SqlStore, admin) -> None:
    """Its COMMIT may have been applied: completing the task again would answer False for the task this
    worker completed. Here the backend ended before the COMMIT reached it, so nothing was applied."""
    ref, task_id, token = _worker_with_a_task(store)
    begun = []
    event.listen(store._engine, "begin", begun.append)

    @event.listens_for(store._engine, "commit")
    def _break_at_commit(conn) -> None:  # before the COMMIT is sent
        _terminate(admin, [conn.connection.dbapi_connection.info.backend_pid])

    with pytest.raises(Unavailable) as raised:
        store.complete_task(ref, task_id, token, {"reward": 1.0})
    assert type(raised.value) is Unavailable and len(begun) == 1
    event.remove(store._engine, "commit", _break_at_commit)
    assert store.step_states("r", 1) == ["leased"]
    assert store.complete_task(ref, task_id, token, {"reward": 1.0})


def test_no_round_trip_checks_a_connection_before_a_call(store: SqlStore, monkeypatch) -> None:
    """The pool's pre-ping was a round trip per call (SELECT 1, sent past the cursor events)."""
    store.apply_run("r", SPEC)
    pings: list[object] = []
    monkeypatch.setattr(store._engine.dialect, "do_ping", pings.append)
    sent: list[str] = []
    event.listen(store._engine, "before_cursor_execute", lambda conn, cursor, sql, *rest: sent.append(sql))
    store.get_run("r")
    assert pings == [] and len(sent) == 1
