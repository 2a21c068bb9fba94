"""The rollout task queue in SQL: the task half of SqlStore (a mixin; it needs `_tx`, `_insert_ignore`).

Used through the Store interface by the actor (enqueue, reset, step results) and by rollout workers
(lease, renew, complete). A task is leased to one worker at a time; a lease that expires makes it
claimable again, and every lease bumps `lease_token`, so a late completion from a worker that lost
its lease is refused. A worker that ends (the controller's end_worker, its own report_exit) gives its
leases back in the same transaction (`_release_leases`): its tasks are queued again at once instead
of after their lease runs out, and only that incarnation's, named by its holder id. Claiming takes the oldest claimable task by (step, slot): PostgreSQL skips rows
another transaction has locked (`FOR UPDATE SKIP LOCKED`), SQLite has one writer at a time; both
then write through an UPDATE guarded by the token they read.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, or_, text, update
from sqlmodel import Session, select

from mortal.state.fencing import check_worker
from mortal.state.store import STALE_ROLLOUTS, NewTask, TaskTally, WorkerRef
from mortal.state.tables import OPEN_TASK, EventRow, TaskRow, as_utc, utcnow


class TaskQueue:
    """Task-queue methods of SqlStore."""

    def enqueue_tasks(self, worker: WorkerRef, tasks: list[NewTask]) -> int:
        with self._tx() as s:
            check_worker(s, worker)
            rows = (
                TaskRow(run=worker.run, step=t.step, slot=t.slot, min_weight_version=t.min_weight_version, payload=t.payload)
                for t in tasks
            )
            return sum(self._insert_ignore(s, TaskRow, row.model_dump(exclude={"id"})) for row in rows)

    def reset_tasks(self, worker: WorkerRef, from_step: int) -> int:
        with self._tx() as s:
            check_worker(s, worker)
            return s.execute(delete(TaskRow).where(TaskRow.run == worker.run, TaskRow.step >= from_step)).rowcount

    def lease_task(
        self,
        worker: WorkerRef,
        lease_seconds: float,
        max_weight_version: int | None = None,
        now: datetime | None = None,
    ) -> TaskRow | None:
        now = as_utc(now) if now else utcnow()
        claimable = or_(TaskRow.state == "queued", and_(TaskRow.state == "leased", TaskRow.lease_expires_at <= now))
        # `state <> 'done'` is implied by `claimable`; written out, it lets the planners use ix_tasks_open.
        query = select(TaskRow).where(TaskRow.run == worker.run, text(OPEN_TASK), claimable)
        if max_weight_version is not None:
            query = query.where(TaskRow.min_weight_version <= max_weight_version)
        oldest = query.order_by(TaskRow.step, TaskRow.slot).limit(1).with_for_update(skip_locked=True)
        # One statement claims it: the subquery locks the oldest claimable row (PostgreSQL skips rows other
        # transactions hold; SQLite has one writer at a time) and the UPDATE takes it, returning the row.
        # Two round trips per lease with the fence check, where a read, a write and a re-read made four.
        claim = (
            update(TaskRow)
            .where(TaskRow.id == oldest.with_only_columns(TaskRow.id).scalar_subquery())
            .values(
                state="leased",
                lease_holder=worker.id,
                lease_token=TaskRow.lease_token + 1,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                attempts=TaskRow.attempts + 1,
            )
            .returning(*TaskRow.__table__.columns)
            .execution_options(synchronize_session=False)
        )
        with self._tx() as s:
            check_worker(s, worker)
            claimed = s.execute(claim).mappings().first()
            return None if claimed is None else TaskRow.model_validate(dict(claimed))

    def _held(self, worker: WorkerRef, task_id: int, lease_token: int) -> Any:
        """WHERE clause: the task is still leased to this worker under this token."""
        return and_(
            TaskRow.id == task_id,
            TaskRow.run == worker.run,
            TaskRow.lease_holder == worker.id,  # ids can be reused after reset_tasks on SQLite; holders cannot
            TaskRow.lease_token == lease_token,
            TaskRow.state == "leased",
        )

    def _release_leases(self, session: Session, worker: WorkerRef) -> int:
        """Queue again every task still leased to exactly this incarnation (it has ended); returns how many.

        Called inside the transaction that ends the worker's row, so no moment exists where the row has
        ended but its tasks wait for their leases to run out. The holder id names run, slot and
        incarnation: a newer incarnation of the slot, or another worker, keeps its leases. A late
        complete_task of the ended incarnation is refused twice over: it is fenced, and the task is no
        longer leased to it (the next lease bumps lease_token too).
        """
        statement = (
            update(TaskRow)
            .where(TaskRow.run == worker.run, TaskRow.lease_holder == worker.id, TaskRow.state == "leased")
            .values(state="queued", lease_holder=None, lease_expires_at=None)
        )
        return session.execute(statement.execution_options(synchronize_session=False)).rowcount

    def renew_task(self, worker: WorkerRef, task_id: int, lease_token: int, lease_seconds: float) -> bool:
        with self._tx() as s:
            check_worker(s, worker)
            expires = utcnow() + timedelta(seconds=lease_seconds)
            statement = update(TaskRow).where(self._held(worker, task_id, lease_token)).values(lease_expires_at=expires)
            return s.execute(statement.execution_options(synchronize_session=False)).rowcount == 1

    def complete_task(self, worker: WorkerRef, task_id: int, lease_token: int, result: dict[str, Any]) -> bool:
        with self._tx() as s:
            check_worker(s, worker)
            statement = (
                update(TaskRow)
                .where(self._held(worker, task_id, lease_token))
                .values(state="done", result=result, done_at=utcnow(), lease_expires_at=None)
            )
            return s.execute(statement.execution_options(synchronize_session=False)).rowcount == 1

    def step_results(self, run: str, step: int) -> list[TaskRow]:
        with self._tx(write=False) as s:
            return list(s.exec(select(TaskRow).where(TaskRow.run == run, TaskRow.step == step).order_by(TaskRow.slot)).all())

    def task_tally(self, run: str) -> TaskTally:
        counts = select(
            func.count(func.distinct(TaskRow.step)), func.count(TaskRow.id),
            func.coalesce(func.sum(case((TaskRow.state == "done", 1), else_=0)), 0),
            func.coalesce(func.sum(case((TaskRow.attempts > 1, TaskRow.attempts - 1), else_=0)), 0),
        ).where(TaskRow.run == run)
        stale = select(func.count(EventRow.id)).where(EventRow.run == run, EventRow.reason == STALE_ROLLOUTS)
        with self._tx(write=False) as s:
            steps, tasks, done, releases = s.execute(counts).one()
            return TaskTally(steps, tasks, int(done), int(releases), s.execute(stale).scalar_one())

    def step_states(self, run: str, step: int) -> list[str]:
        with self._tx(write=False) as s:
            return list(s.exec(select(TaskRow.state).where(TaskRow.run == run, TaskRow.step == step)
                               .order_by(TaskRow.slot)).all())
