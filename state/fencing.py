"""Fencing checks run inside a store transaction, before the write they guard.

Called only by SqlStore (and its task-queue part). A check and the write it guards share one
transaction and the checked row stays locked until commit (`FOR SHARE` / `FOR UPDATE` on
PostgreSQL; SQLite's single writer, taken at BEGIN IMMEDIATE), so a takeover cannot slip in between.
"""

from __future__ import annotations

from sqlmodel import Session, select

from mortal.state.errors import Fenced
from mortal.state.store import LeaderFence, WorkerRef
from mortal.state.tables import LeaseRow, RunRow, WorkerRow, utcnow

TERMINAL_WORKER_STATES = frozenset({"Succeeded", "Failed", "Lost", "Stopped"})


def check_leader(session: Session, fence: LeaderFence | None) -> None:
    """Fenced unless lease `fence.name` is held by `fence.holder` with `fence.token`, unexpired."""
    if fence is None:
        return
    query = select(LeaseRow).where(LeaseRow.name == fence.name).with_for_update(read=True)
    lease = session.exec(query).first()
    if lease is None or lease.holder != fence.holder or lease.token != fence.token:
        raise Fenced(f"lease {fence.name!r} is not held by {fence.holder!r} with token {fence.token}")
    if lease.expires_at <= utcnow():
        raise Fenced(f"lease {fence.name!r} of {fence.holder!r} expired at {lease.expires_at.isoformat()}")


def check_worker(session: Session, worker: WorkerRef, for_update: bool = False) -> WorkerRow:
    """The worker's row, if it is the newest incarnation of its slot and not ended; else Fenced.

    `for_update` when the caller writes the worker row itself (two share locks upgraded to
    write locks by two transactions would deadlock on PostgreSQL).
    """
    # One round trip: the run's uid comes along (outer join: a run row deleted by a purge reads as None).
    # Only the worker row is locked (OF workers): a FOR SHARE on the run row would make every worker
    # write wait for the controller's status write, and the other way round.
    query = (
        select(WorkerRow, RunRow.uid)
        .join(RunRow, RunRow.name == WorkerRow.run, isouter=True)
        .where(WorkerRow.run == worker.run, WorkerRow.role == worker.role, WorkerRow.replica == worker.replica)
        .order_by(WorkerRow.incarnation.desc())
        .limit(1)
        .with_for_update(read=not for_update, of=WorkerRow)
    )
    found = session.exec(query).first()
    newest, uid = found if found is not None else (None, None)
    if newest is None or newest.incarnation != worker.incarnation:
        current = "none" if newest is None else newest.incarnation
        raise Fenced(f"{worker.id} is not the live incarnation of its slot (newest: {current})")
    if newest.state in TERMINAL_WORKER_STATES:
        raise Fenced(f"{worker.id} has ended ({newest.state})")
    if worker.run_uid is not None and uid != worker.run_uid:
        raise Fenced(f"{worker.id} was launched for an earlier run named {worker.run!r} (uid {worker.run_uid})")
    return newest
