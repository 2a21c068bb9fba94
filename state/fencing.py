"""Fencing checks run inside a store transaction, before the write they guard.

Called only by SqlStore (and its task-queue and completions parts), on its Session or, in the hot calls,
its Connection. A check and the write it guards share one transaction and the checked row stays locked
until commit (`FOR SHARE` / `FOR UPDATE` on PostgreSQL; SQLite's single writer, taken at BEGIN
IMMEDIATE), so a takeover cannot slip in between. The statements are built once, with bound parameters:
building one per call was a good part of a call's Python.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam
from sqlalchemy.engine import Connection
from sqlmodel import Session, select

from mortal.state.errors import Fenced
from mortal.state.store import LeaderFence, WorkerRef
from mortal.state.tables import LeaseRow, RunRow, WorkerRow, table_of, utcnow

TERMINAL_WORKER_STATES = frozenset({"Succeeded", "Failed", "Lost", "Stopped"})
_WORKERS, _RUNS = table_of(WorkerRow), table_of(RunRow)


def _newest_of_slot(for_update: bool) -> Any:
    """The slot's newest incarnation with its run's uid, its worker row locked.

    One round trip: the run's uid comes along (outer join: a run row deleted by a purge reads as None).
    Only the worker row is locked (OF workers): a FOR SHARE on the run row would make every worker write
    wait for the controller's status write, and the other way round.
    """
    workers = _WORKERS.c
    return (
        select(workers.id, workers.incarnation, workers.state, _RUNS.c.uid)
        .select_from(_WORKERS.outerjoin(_RUNS, _RUNS.c.name == workers.run))
        .where(
            workers.run == bindparam("fence_run"),
            workers.role == bindparam("fence_role"),
            workers.replica == bindparam("fence_replica"),
        )
        .order_by(workers.incarnation.desc())
        .limit(1)
        .with_for_update(read=not for_update, of=_WORKERS)
    )


_NEWEST_OF_SLOT = {False: _newest_of_slot(False), True: _newest_of_slot(True)}
CHECK_STATEMENTS = tuple(_NEWEST_OF_SLOT.values())  # every worker write's (SqlStore warms them)


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


def check_worker(executor: Session | Connection, worker: WorkerRef, for_update: bool = False) -> int:
    """The id of the worker's row, if it is the newest incarnation of its slot and not ended; else Fenced.

    `for_update` when the caller writes the worker row itself (two share locks upgraded to
    write locks by two transactions would deadlock on PostgreSQL).
    """
    slot = {"fence_run": worker.run, "fence_role": worker.role, "fence_replica": worker.replica}
    newest = executor.execute(_NEWEST_OF_SLOT[for_update], slot).first()
    if newest is None or newest.incarnation != worker.incarnation:
        current = "none" if newest is None else newest.incarnation
        raise Fenced(f"{worker.id} is not the live incarnation of its slot (newest: {current})")
    if newest.state in TERMINAL_WORKER_STATES:
        raise Fenced(f"{worker.id} has ended ({newest.state})")
    if worker.run_uid is not None and newest.uid != worker.run_uid:
        raise Fenced(
            f"{worker.id} was launched for an earlier run named {worker.run!r} (uid {worker.run_uid})"
        )
    return int(newest.id)
