"""The lease's claim walks ix_tasks_open in claim order and stops at the first task it can take, also in
a database whose statistics were never gathered (a new database, a queue just filled): on PostgreSQL the
claim once read every open task of the run and sorted them, on every lease, because the planner took its
"queued, or leased and run out" for a handful of rows. On SQLite and PostgreSQL; EXPLAIN, no ANALYZE.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Connection

from mortal.state import WorkerRef, open_store
from mortal.state.sql_store import SqlStore
from mortal.state.store import NewTask
from mortal.state.tables import utcnow
from mortal.state.task_queue import _CLAIM

TASKS = 2000


def _plan(conn: Connection, statement: Any, params: dict[str, Any]) -> str:
    """The database's plan for `statement` with `params` (EXPLAIN; nothing is executed)."""
    compiled = statement.compile(dialect=conn.dialect)
    values = {**compiled.params, **params}
    if conn.dialect.name == "sqlite":
        positional = tuple(values[name] for name in compiled.positiontup or ())
        rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", positional).all()
        return "\n".join(str(row[-1]) for row in rows)
    rows = conn.exec_driver_sql(f"EXPLAIN {compiled}", values).all()
    return "\n".join(str(row[0]) for row in rows)


@pytest.fixture
def queued(sql_store_url: str) -> Any:
    store = open_store(sql_store_url)
    assert isinstance(store, SqlStore)
    store.apply_run("r", {"model": {"name": "m"}})
    actor = store.create_worker("r", "actor", 0, "local", 60)
    ref = WorkerRef("r", "actor", 0, actor.incarnation)
    for start in range(0, TASKS, 500):
        batch = [
            NewTask(step=i // 8, slot=i % 8, min_weight_version=0, payload={})
            for i in range(start, start + 500)
        ]
        store.enqueue_tasks(ref, batch)
    try:
        yield store
    finally:
        store.close()


def test_the_claim_walks_the_open_tasks_in_order(queued: SqlStore) -> None:
    """The lease without a weight bound (the one rollout workers make; with a bound, PostgreSQL still
    sorts until the table has been analyzed: task_queue._claim)."""
    now = utcnow()
    params = {
        "b_run": "r",
        "b_now": now if queued._engine.dialect.name != "sqlite" else now.isoformat(),
        "b_holder": "r/rollout/0/1",
        "b_expires": now + timedelta(seconds=30) if queued._engine.dialect.name != "sqlite" else "",
    }
    with queued._engine.connect() as conn:
        plan = _plan(conn, _CLAIM[False], params)
    assert "ix_tasks_open" in plan, plan
    assert "Sort" not in plan and "TEMP B-TREE" not in plan, plan  # PostgreSQL's, SQLite's sort
    assert "Bitmap" not in plan, plan  # a bitmap scan gives no order: it reads them all, then sorts
