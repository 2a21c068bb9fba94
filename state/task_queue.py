"""The rollout task queue in SQL: the task half of SqlStore (a mixin; it needs `_tx`, `_insert_ignore`).

Used through the Store interface by the actor (enqueue, reset, step results) and by rollout workers
(lease, renew, complete). A task is leased to one worker at a time; a lease that expires makes it
claimable again, and every lease bumps `lease_token`, so a late completion from a worker that lost
its lease is refused. A worker that ends (the controller's end_worker, its own report_exit) gives its
leases back in the same transaction (`_release_leases`): its tasks are queued again at once instead
of after their lease runs out, and only that incarnation's, named by its holder id. Claiming takes the
oldest claimable task by (step, slot) in one UPDATE whose subquery locks it: PostgreSQL skips rows
another transaction has locked (`FOR UPDATE SKIP LOCKED`), SQLite has one writer at a time. Renewals and
completions are UPDATEs guarded by the lease's holder and token.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import and_, bindparam, case, delete, func, not_, text, update
from sqlalchemy.engine import Connection, CursorResult
from sqlmodel import Session, SQLModel, col, select

from mortal.state.fencing import check_worker
from mortal.state.store import STALE_ROLLOUTS, NewTask, TaskTally, WorkerRef
from mortal.state.tables import OPEN_TASK, EventRow, TaskRow, as_utc, table_of, utcnow

_TASKS = table_of(TaskRow)
_NO_SESSION_SYNC = {"synchronize_session": False}


def _claim(weight_bounded: bool) -> Any:
    """UPDATE ... RETURNING that leases the oldest claimable task of a run to a worker, in one statement.

    The subquery locks the oldest claimable row (PostgreSQL skips rows other transactions hold; SQLite has
    one writer at a time) and the UPDATE takes it, returning the row. `weight_bounded`: only tasks whose
    min_weight_version is at most `b_max_weight_version`.
    """
    tasks = _TASKS.c
    now = bindparam("b_now", type_=tasks.lease_expires_at.type)
    # Claimable: open (OPEN_TASK, ix_tasks_open's own condition) and not under a lease still running.
    # Written as "not running" rather than "queued, or leased and run out": PostgreSQL guesses how many
    # rows a condition keeps, and for a table it has not analyzed yet (a new database, a queue just
    # filled) it took the latter for a row or two, so it read every open task of the run and sorted them
    # on every lease, instead of walking ix_tasks_open in claim order to the first task it can take
    # (tests/state/test_claim_plan.py). The weight bound still makes that guess small enough for the
    # sort, until the table has been analyzed.
    running = and_(tasks.state == "leased", tasks.lease_expires_at > now)
    oldest = select(tasks.id).where(tasks.run == bindparam("b_run"), text(OPEN_TASK), not_(running))
    if weight_bounded:
        oldest = oldest.where(tasks.min_weight_version <= bindparam("b_max_weight_version"))
    oldest = oldest.order_by(tasks.step, tasks.slot).limit(1).with_for_update(skip_locked=True)
    return (
        update(_TASKS)
        .where(tasks.id == oldest.scalar_subquery())
        .values(
            state="leased",
            lease_holder=bindparam("b_holder"),
            lease_token=tasks.lease_token + 1,
            lease_expires_at=bindparam("b_expires"),
            attempts=tasks.attempts + 1,
        )
        .returning(*_TASKS.c)
    )


_CLAIM = {False: _claim(False), True: _claim(True)}


def rowcount(result: Any) -> int:
    """The rows an UPDATE or DELETE matched (a Session's Result of one is a CursorResult)."""
    return cast(CursorResult[Any], result).rowcount


# The task is still leased to this worker (b_holder) under this token: a renewal or completion applies.
# Holders are worker ids (run, slot, incarnation); task ids can be reused after reset_tasks on SQLite.
_HELD = and_(
    _TASKS.c.id == bindparam("b_task"),
    _TASKS.c.run == bindparam("b_run"),
    _TASKS.c.lease_holder == bindparam("b_holder"),
    _TASKS.c.lease_token == bindparam("b_token"),
    _TASKS.c.state == "leased",
)
_RENEW = update(_TASKS).where(_HELD).values(lease_expires_at=bindparam("b_expires"))
_COMPLETE = (
    update(_TASKS)
    .where(_HELD)
    .values(state="done", result=bindparam("b_result"), done_at=bindparam("b_now"), lease_expires_at=None)
)
LEASE_STATEMENTS = (*_CLAIM.values(), _RENEW, _COMPLETE)  # a rollout worker's calls' (SqlStore warms them)
_RELEASE = (
    update(_TASKS)
    .where(
        _TASKS.c.run == bindparam("b_run"),
        _TASKS.c.lease_holder == bindparam("b_holder"),
        _TASKS.c.state == "leased",
    )
    .values(state="queued", lease_holder=None, lease_expires_at=None)
)


class TaskQueue:
    """Task-queue methods of SqlStore. The worker's calls (lease, renew, complete) run prepared Core
    statements on a Connection (`_conn`): they are most of a busy store's calls."""

    # SqlStore's, of which this is a part.
    _tx: Callable[..., AbstractContextManager[Session]]
    _conn: Callable[..., AbstractContextManager[Connection]]
    _insert_ignore: Callable[[Session, type[SQLModel], dict[str, Any]], bool]

    def enqueue_tasks(self, worker: WorkerRef, tasks: list[NewTask]) -> int:
        with self._tx() as s:
            check_worker(s, worker)
            rows = (
                TaskRow(
                    run=worker.run,
                    step=t.step,
                    slot=t.slot,
                    min_weight_version=t.min_weight_version,
                    payload=t.payload,
                )
                for t in tasks
            )
            return sum(self._insert_ignore(s, TaskRow, row.model_dump(exclude={"id"})) for row in rows)

    def reset_tasks(self, worker: WorkerRef, from_step: int) -> int:
        with self._tx() as s:
            check_worker(s, worker)
            return rowcount(
                s.execute(
                    delete(TaskRow).where(col(TaskRow.run) == worker.run, col(TaskRow.step) >= from_step)
                )
            )

    def lease_task(
        self,
        worker: WorkerRef,
        lease_seconds: float,
        max_weight_version: int | None = None,
        now: datetime | None = None,
    ) -> TaskRow | None:
        now = as_utc(now) if now else utcnow()
        claim = _CLAIM[max_weight_version is not None]
        values = {
            "b_run": worker.run,
            "b_now": now,
            "b_holder": worker.id,
            "b_expires": now + timedelta(seconds=lease_seconds),
        }
        if max_weight_version is not None:  # exactly the statement's parameters: SqlStore.open_connections
            values["b_max_weight_version"] = max_weight_version
        with self._conn() as c:
            check_worker(c, worker)
            claimed = c.execute(claim, values).mappings().first()
        return None if claimed is None else TaskRow.model_validate(dict(claimed))

    def _release_leases(self, executor: Session | Connection, worker: WorkerRef) -> int:
        """Queue again every task still leased to exactly this incarnation (it has ended); returns how many.

        Called inside the transaction that ends the worker's row, so no moment exists where the row has
        ended but its tasks wait for their leases to run out. The holder id names run, slot and
        incarnation: a newer incarnation of the slot, or another worker, keeps its leases. A late
        complete_task of the ended incarnation is refused twice over: it is fenced, and the task is no
        longer leased to it (the next lease bumps lease_token too).
        """
        values = {"b_run": worker.run, "b_holder": worker.id}
        return rowcount(executor.execute(_RELEASE, values, execution_options=_NO_SESSION_SYNC))

    def renew_task(self, worker: WorkerRef, task_id: int, lease_token: int, lease_seconds: float) -> bool:
        with self._conn() as c:
            check_worker(c, worker)
            values = {
                "b_task": task_id,
                "b_run": worker.run,
                "b_holder": worker.id,
                "b_token": lease_token,
                "b_expires": utcnow() + timedelta(seconds=lease_seconds),
            }
            return c.execute(_RENEW, values).rowcount == 1

    def complete_task(
        self, worker: WorkerRef, task_id: int, lease_token: int, result: dict[str, Any]
    ) -> bool:
        with self._conn() as c:
            check_worker(c, worker)
            values = {
                "b_task": task_id,
                "b_run": worker.run,
                "b_holder": worker.id,
                "b_token": lease_token,
                "b_result": result,
                "b_now": utcnow(),
            }
            return c.execute(_COMPLETE, values).rowcount == 1

    def step_results(self, run: str, step: int) -> list[TaskRow]:
        with self._tx(write=False) as s:
            return list(
                s.exec(
                    select(TaskRow)
                    .where(TaskRow.run == run, TaskRow.step == step)
                    .order_by(col(TaskRow.slot))
                ).all()
            )

    def task_tally(self, run: str) -> TaskTally:
        counts = select(
            func.count(func.distinct(TaskRow.step)),
            func.count(col(TaskRow.id)),
            func.coalesce(func.sum(case((col(TaskRow.state) == "done", 1), else_=0)), 0),
            func.coalesce(func.sum(case((col(TaskRow.attempts) > 1, col(TaskRow.attempts) - 1), else_=0)), 0),
        ).where(TaskRow.run == run)
        stale = select(func.count(col(EventRow.id))).where(
            EventRow.run == run, EventRow.reason == STALE_ROLLOUTS
        )
        with self._tx(write=False) as s:
            steps, tasks, done, releases = s.execute(counts).one()
            return TaskTally(steps, tasks, int(done), int(releases), s.execute(stale).scalar_one())

    def step_states(self, run: str, step: int) -> list[str]:
        with self._tx(write=False) as s:
            return list(
                s.exec(
                    select(TaskRow.state)
                    .where(TaskRow.run == run, TaskRow.step == step)
                    .order_by(col(TaskRow.slot))
                ).all()
            )
