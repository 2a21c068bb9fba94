"""Writers recording the same step's metrics at once take the rows' locks in one order: none deadlocks.

add_metrics replaces a step's values (one per name) by deleting the rows it finds, then inserting. Two
writers that delete the same rows lock them one by one, in the order their plan visits them: an index
scan by (run, name, step), a bitmap or sequential scan by place in the table. PostgreSQL may plan the
same statement either way on two connections (statistics, a prepared statement's generic plan), and two
writers locking two rows in opposite orders deadlock: one of them failed (seen with 256 clients, each
recording the same step). Shown by giving two stores the two plans and letting them go at the same
moment, from behind a third transaction holding the rows. PostgreSQL only: SQLite has one writer at a
time, so its writers never hold a row lock while waiting for another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import event

from mortal.state import WorkerRef, open_store
from mortal.state.sql_store import SqlStore

pytestmark = pytest.mark.postgres

SPEC = {"model": {"name": "tiny"}}
# Planner settings that make one store's DELETE walk the index (names in order: "a" before "b") and the
# other's read the table in the order the rows were written ("b" was written first).
INDEX_ORDER = "SET enable_bitmapscan = off; SET enable_seqscan = off"
TABLE_ORDER = "SET enable_indexscan = off; SET enable_indexonlyscan = off"


def _store(url: str, settings: str) -> SqlStore:
    store = open_store(url)
    assert isinstance(store, SqlStore)

    @event.listens_for(store._engine, "connect")
    def _plan_so(dbapi_connection: Any, record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            for setting in settings.split("; "):
                cursor.execute(setting)
        dbapi_connection.commit()

    store._engine.pool.dispose()  # connections opened from now on get the settings
    return store


@pytest.fixture
def pg_url(sql_store_url: str) -> Iterator[str]:
    if not sql_store_url.startswith("postgresql"):
        pytest.skip("row locks in opposite orders: PostgreSQL's (SQLite has one writer at a time)")
    yield sql_store_url


def _waiting(url: str) -> list[list[int]]:
    """The pids blocking each backend of the database that waits for a lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_blocking_pids(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchall()
    return [list(row[0]) for row in rows]


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _holding(url: str, name: str) -> psycopg.Connection:
    """A transaction holding the lock of metric `name`'s row (run r, step 1)."""
    conn = psycopg.connect(url)
    conn.execute("SELECT * FROM metrics WHERE run = 'r' AND step = 1 AND name = %s FOR UPDATE", (name,))
    return conn


def test_two_writers_of_the_same_step_neither_fails_nor_doubles_a_name(pg_url: str) -> None:
    """Writer 1 would take "a" then "b", writer 2 "b" then "a". Held back by two transactions holding
    "a" and "b", they are let go one row at a time: "a" first (writer 1 takes it and waits for "b"),
    then "b" (writer 2, first in line for it, takes it). Writing in their plans' orders, each then waits
    for the other: PostgreSQL ends one of them (a deadlock). Writing in one order, both finish."""
    by_index, by_table = _store(pg_url, INDEX_ORDER), _store(pg_url, TABLE_ORDER)
    try:
        by_index.apply_run("r", SPEC)
        refs = [
            WorkerRef("r", "rollout", i, by_index.create_worker("r", "rollout", i, "local", 60).incarnation)
            for i in range(2)
        ]
        by_index.add_metrics(refs[0], 1, {"b": 1.0, "a": 1.0})
        errors: list[BaseException] = []

        def record(store: SqlStore, ref: WorkerRef, value: float) -> None:
            try:
                store.add_metrics(ref, 1, {"a": value, "b": value})
            except BaseException as exc:  # the test thread reports it
                errors.append(exc)

        hold_a, hold_b = _holding(pg_url, "a"), _holding(pg_url, "b")
        try:
            writers = [
                threading.Thread(target=record, args=(by_index, refs[0], 2.0)),
                threading.Thread(target=record, args=(by_table, refs[1], 3.0)),
            ]
            for writer in writers:
                writer.start()
            _until(lambda: len(_waiting(pg_url)) == 2, "both writers wait for the held rows")
            a_holder = hold_a.info.backend_pid
            hold_a.rollback()
            _until(
                lambda: len(w := _waiting(pg_url)) == 2 and all(a_holder not in pids for pids in w),
                "both writers wait again, none for the transaction that held a",
            )
            hold_b.rollback()
            for writer in writers:
                writer.join(timeout=60)
        finally:
            hold_a.close()
            hold_b.close()
        assert errors == []
        values = sorted((m.name, m.value) for m in by_index.list_metrics("r"))
        assert values in ([("a", 2.0), ("b", 2.0)], [("a", 3.0), ("b", 3.0)])
    finally:
        by_index.close()
        by_table.close()
