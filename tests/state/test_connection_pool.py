"""The store server's database connections: as many kept open as it has threads, opened when it starts.

Why: SQLAlchemy's pool keeps 5 connections and closes the ones it opened past them when they come back,
so a server with 8 threads opened and closed connections whenever more than 5 calls ran at once (on
PostgreSQL a new server process each time, while its call waited), and every thread opened its first
connection during a client's call. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event

from mortal.state import NewTask, WorkerRef, open_store
from mortal.state.http_server import make_app
from mortal.state.sql_store import SqlStore

THREADS = 8


def _opened(store: SqlStore) -> list[object]:
    """Connections the store's pool opens from now on (one item each)."""
    opened: list[object] = []
    event.listen(store._engine.pool, "connect", lambda dbapi_connection, record: opened.append(record))
    return opened


def _all_at_once(store: SqlStore, threads: int, rounds: int) -> None:
    """`threads` threads each holding a connection of the store's pool at the same moment, `rounds` times."""
    held = threading.Barrier(threads)
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            for _ in range(rounds):
                with store._engine.connect():
                    held.wait(timeout=30)
                held.wait(timeout=30)  # all returned before the next round takes them again
        except BaseException as exc:  # the test thread reports it
            errors.append(exc)

    workers = [threading.Thread(target=hold) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors, errors


@pytest.fixture
def sized(sql_store_url: str) -> Iterator[SqlStore]:
    store = open_store(sql_store_url, connections=THREADS)
    assert isinstance(store, SqlStore)
    try:
        yield store
    finally:
        store.close()


def test_connections_are_open_before_the_first_call(sized: SqlStore) -> None:
    assert sized._engine.pool.checkedin() == THREADS


def test_as_many_calls_at_once_as_connections_open_none(sized: SqlStore) -> None:
    opened = _opened(sized)
    _all_at_once(sized, THREADS, rounds=3)
    assert opened == []
    assert sized._engine.pool.checkedin() == THREADS


def test_without_a_size_the_pool_reopens_what_a_burst_needed(sql_store_url: str) -> None:
    """What the sized pool prevents: the default pool closes the connections it opened past its size,
    and opens them again for the next burst (so the test above can fail)."""
    store = open_store(sql_store_url)
    assert isinstance(store, SqlStore)
    try:
        opened = _opened(store)
        _all_at_once(store, THREADS, rounds=2)
        first_round = THREADS
        assert len(opened) > first_round
    finally:
        store.close()


def test_the_server_opens_a_connection_per_thread(sql_store_url: str) -> None:
    app = make_app(sql_store_url, "pool-test-admin-token", threads=3)
    try:
        assert isinstance(app.store, SqlStore)
        assert app.store._engine.pool.checkedin() == 3
    finally:
        app.close()


def test_an_http_store_has_no_connections_to_open() -> None:
    with pytest.raises(ValueError, match="connections"):
        open_store("http://127.0.0.1:1", connections=2)


def test_the_hot_calls_find_their_statements_compiled(sql_store_url: str) -> None:
    """After open_connections, a worker's calls compile nothing: each of their statements was run once
    per connection at the start (matching no row), so their first calls do not compile in a burst."""
    from sqlalchemy.engine.default import CACHE_MISS

    setup = open_store(sql_store_url)
    setup.apply_run("r", {"model": {"name": "m"}})
    actor = setup.create_worker("r", "actor", 0, "local", 60)
    setup.enqueue_tasks(
        WorkerRef("r", "actor", 0, actor.incarnation),
        [NewTask(step=1, slot=k, min_weight_version=0) for k in range(2)],
    )
    ref = WorkerRef("r", "rollout", 0, setup.create_worker("r", "rollout", 0, "local", 60).incarnation)
    setup.close()
    store = open_store(sql_store_url, connections=2)
    assert isinstance(store, SqlStore)
    compiled: list[str] = []

    @event.listens_for(store._engine, "after_cursor_execute")
    def _note(
        conn: object, cursor: object, statement: str, params: object, context: object, many: bool
    ) -> None:
        if getattr(context, "cache_hit", None) == CACHE_MISS:
            compiled.append(statement.split("\n")[0])

    try:
        store.heartbeat(ref, step=1)
        task = store.lease_task(ref, 30.0)
        assert task is not None
        assert store.lease_task(ref, 30.0, max_weight_version=0) is not None
        assert store.renew_task(ref, task.id, task.lease_token, 30.0)
        assert store.complete_task(ref, task.id, task.lease_token, {"reward": 1.0})
        store.get_run("r")
        store.latest_weights("r")
        assert compiled == []
    finally:
        store.close()


def test_the_hot_reads_run_without_begin_and_commit_on_postgres(sql_store_url: str) -> None:
    """get_run and latest_weights are one SELECT each: on PostgreSQL it runs on its own (autocommit), not
    between a BEGIN and a COMMIT that were two more round trips; writes keep their transactions, also on a
    connection a read has just used. SQLite keeps the transaction (it costs no round trip)."""
    store = open_store(sql_store_url, connections=1)
    assert isinstance(store, SqlStore)
    postgres = store._engine.dialect.name == "postgresql"
    seen: list[tuple[str, bool]] = []

    @event.listens_for(store._engine, "before_cursor_execute")
    def _note(conn: Any, cursor: object, statement: str, params: object, context: object, many: bool) -> None:
        if statement.startswith("BEGIN"):  # SQLite's, sent by the engine's begin hook
            return
        dbapi = conn.connection.dbapi_connection
        seen.append((statement.split()[0], bool(getattr(dbapi, "autocommit", False)) if postgres else False))

    try:
        store.apply_run("r", {"model": {"name": "m"}})
        ref = WorkerRef("r", "rollout", 0, store.create_worker("r", "rollout", 0, "local", 60).incarnation)
        seen.clear()
        store.get_run("r")
        store.latest_weights("r")
        store.heartbeat(ref, step=1)
        reads, writes = seen[:2], seen[2:]
        assert [name for name, _ in reads] == ["SELECT", "SELECT"]
        assert all(autocommit == postgres for _, autocommit in reads)
        assert writes and not any(autocommit for _, autocommit in writes)
    finally:
        store.close()
