"""A run's budgets (spec.limits): its active-time clock, its GPU time, and whether a limit is reached.

Called by `mortal.controller.plan` (pure, like it: no I/O, no clock of its own; `now` is given).
Active time leaves out time while Suspended (as Kubernetes' activeDeadlineSeconds does) and lives in
the stored status as `activeSeconds` and `activeSince`, values that change only when the run starts,
suspends, resumes or finishes: a restarted controller counts on from the same clock, and an idle pass
writes nothing. GPU time is rebuilt every pass from the workers table (wall time x GPUs held), a
worker's time ending at its row's end or its last heartbeat plus its lease, whichever is sooner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from mortal.specs import format_duration

SUSPENDED, SUCCEEDED, FAILED = "Suspended", "Succeeded", "Failed"
DEADLINE_EXCEEDED = "DeadlineExceeded"  # limits.maxDuration reached (Kubernetes Job's reason)
BUDGET_EXCEEDED = "BudgetExceeded"  # limits.maxGPUHours reached
GPU_HOURS_PRECISION = 2  # status.gpuHours is rounded to 0.01 GPU-hour (36 GPU-seconds): fewer status writes


class GPUTime(Protocol):
    """What GPU accounting reads of a worker row (mortal.state.tables.WorkerRow, or plan's view of one)."""

    @property
    def gpus(self) -> int: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def ended_at(self) -> datetime | None: ...
    @property
    def heartbeat_at(self) -> datetime | None: ...
    @property
    def lease_seconds(self) -> float: ...


@dataclass(frozen=True)
class Exceeded:
    """A limit the run reached: the reason its Failed condition carries, and what to tell the user."""

    reason: str
    message: str


def is_active(phase: str) -> bool:
    """Phases whose time counts against maxDuration: all but Suspended and the terminal ones."""
    return phase not in (SUSPENDED, SUCCEEDED, FAILED)


def active_time(prev: Mapping[str, Any], now: datetime) -> float:
    """Active seconds up to `now`, by the clock in the previous status."""
    since = _time(prev.get("activeSince"))
    seconds = float(prev.get("activeSeconds") or 0.0)
    return seconds + (max(0.0, (now - since).total_seconds()) if since is not None else 0.0)


def next_clock(prev: Mapping[str, Any], phase: str, now: datetime) -> tuple[float, str | None]:
    """(activeSeconds, activeSince) for a status of `phase` written at `now`: a period starts when the run
    becomes active, and is folded into activeSeconds when it suspends or finishes."""
    since = prev.get("activeSince")
    if is_active(phase):
        return float(prev.get("activeSeconds") or 0.0), since or now.isoformat()
    return active_time(prev, now), None


def worker_gpu_seconds(row: GPUTime, now: datetime) -> float:
    """GPU-seconds of one worker row: wall time (start to end, or to now while it lives) x the GPUs it
    holds."""
    if not row.gpus:
        return 0.0
    end = row.ended_at or now
    if row.heartbeat_at is not None:
        end = min(end, row.heartbeat_at + timedelta(seconds=row.lease_seconds))
    return max(0.0, (end - row.started_at).total_seconds()) * row.gpus


def gpu_seconds(rows: Iterable[GPUTime], now: datetime) -> float:
    """GPU-seconds of every worker the run launched (relaunches included)."""
    return sum(worker_gpu_seconds(row, now) for row in rows)


def gpu_hours(seconds: float) -> float:
    """status.gpuHours: GPU-seconds as hours, rounded to 0.01."""
    return round(seconds / 3600.0, GPU_HOURS_PRECISION)


def exceeded(
    max_duration: float | None,
    active: float,
    max_gpu_hours: float | None,
    used_gpu_seconds: float,
    already: str | None = None,
) -> Exceeded | None:
    """The first limit reached, if any (maxDuration before maxGPUHours). `already`: the reason an earlier pass
    found for the same spec; it holds while that limit is set, so that a run whose workers are stopping is
    not relaunched because their final accounting came out a second short."""
    if max_duration is not None and (active >= max_duration or already == DEADLINE_EXCEEDED):
        return Exceeded(
            DEADLINE_EXCEEDED,
            f"limits.maxDuration ({format_duration(max_duration)}) reached: active for {_span(active)}",
        )
    if max_gpu_hours is not None and (
        used_gpu_seconds >= max_gpu_hours * 3600.0 or already == BUDGET_EXCEEDED
    ):
        return Exceeded(
            BUDGET_EXCEEDED,
            f"limits.maxGPUHours ({max_gpu_hours:g}) reached: the workers used "
            f"{used_gpu_seconds / 3600.0:.2f} GPU-hours",
        )
    return None


def seconds_left(
    max_duration: float | None,
    active: float,
    max_gpu_hours: float | None,
    used_gpu_seconds: float,
    live_gpus: int,
) -> float | None:
    """Wall seconds until the first limit is reached at the present rate (None: no limit can be reached)."""
    left = []
    if max_duration is not None:
        left.append(max_duration - active)
    if max_gpu_hours is not None and live_gpus > 0:
        left.append((max_gpu_hours * 3600.0 - used_gpu_seconds) / live_gpus)
    return max(0.0, min(left)) if left else None


def _span(seconds: float) -> str:
    """90 -> '1m30s', 7200 -> '2h0m0s'; fractions of a second only below a minute."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"


def _time(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(value)
