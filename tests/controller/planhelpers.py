"""Builders for plan() inputs: worker rows, backend processes and desired state at a fixed `NOW`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from itertools import count
from typing import Any

from mortal.controller.backends.base import BackendWorker
from mortal.controller.observed import Desired, Observed, PlanConfig
from mortal.controller.plan import Plan, plan
from mortal.state.store import WorkerRef
from mortal.state.tables import CheckpointRow, WorkerRow

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
RUN = "r"
CFG = PlanConfig()
_ids = count(1)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def row(
    role: str = "actor",
    replica: int = 0,
    inc: int = 1,
    state: str = "Running",
    *,
    handle: str | None = "h",
    beat: float | None = 0.5,
    started: float = 100.0,
    ended: float | None = None,
    step: int | None = None,
    code: int | None = None,
    message: str | None = None,
    lease: float = 10.0,
    version: int | None = None,
) -> WorkerRow:
    """A worker row; times are seconds before NOW. Ended states get ended_at (default: 1 s ago)."""
    if state not in ("Pending", "Running") and ended is None:
        ended = 1.0
    return WorkerRow(
        id=next(_ids),
        run=RUN,
        role=role,
        replica=replica,
        incarnation=inc,
        backend="local",
        handle=(f"{handle}{inc}" if handle else None),
        state=state,
        heartbeat_at=None if beat is None else ago(beat),
        lease_seconds=lease,
        step=step,
        weight_version=version,
        exit_code=code,
        message=message,
        started_at=ago(started),
        ended_at=None if ended is None else ago(ended),
    )


def proc(
    w: WorkerRow,
    alive: bool = True,
    code: int | None = None,
    handle: str | None = None,
    uid: str | None = None,
) -> BackendWorker:
    """The backend's view of `w`'s process (launched for the run of `uid`, when given)."""
    ref = WorkerRef(w.run, w.role, w.replica, w.incarnation, run_uid=uid)
    return BackendWorker(
        worker_id=ref.process_id,
        handle=handle or w.handle or f"pid{w.incarnation}",
        run=w.run,
        role=w.role,
        replica=w.replica,
        incarnation=w.incarnation,
        alive=alive,
        exit_code=code,
        run_uid=uid or "",
    )


def running(rollouts: int = 1, step: int = 5) -> tuple[list[WorkerRow], list[BackendWorker]]:
    """A healthy run: actor + `rollouts` rollout workers, all heartbeating, processes alive."""
    rows = [row("actor", 0, 1, step=step)] + [row("rollout", i, 2 + i) for i in range(rollouts)]
    return rows, [proc(w) for w in rows]


def status(phase: str, **extra: Any) -> dict[str, Any]:
    return {"phase": phase, **extra}


def run_plan(
    rows: list[WorkerRow],
    procs: list[BackendWorker] = (),
    prev: dict[str, Any] | None = None,
    ckpt: CheckpointRow | None = None,
    cfg: PlanConfig = CFG,
    weights: int | None = None,
    reward: float | None = None,
    metrics: dict[int, dict[str, float]] | None = None,
    weights_at: datetime | None = None,
    now: datetime = NOW,
    **desired: Any,
) -> Plan:
    d = Desired(name=RUN, **desired)
    o = Observed(
        workers=rows,
        processes=procs,
        status=prev or {},
        checkpoint=ckpt,
        weight_version=weights,
        weights_at=weights_at,
        reward=reward,
        metrics=metrics,
    )
    return plan(d, o, now, cfg)


def kinds(p: Plan) -> list[str]:
    return [type(a).__name__ for a in p.actions]
