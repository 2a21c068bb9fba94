"""The deadline of each activity a worker reports, and the verdict on one that ran past it: the
watchdog's rules.

Called only by `plan` (stall detection, the DeadlinesMet condition, and the give-up of a slot that
stalls the same way every time); tests call each function with hand-built inputs. Pure: no I/O, no
clock of its own (`now` is passed in).
Deadlines (spec.deadlines; docs/deadlines.md): a value the spec sets is used as it is. Unset, a task's
and a step's come from the run's own step times, as the progress deadline does; a task's is never
below its reward calls' timeouts added up (a reward call past its own deadline is the cheaper heal),
and a step's is at least twice a task's (a step outlasts one of its tasks healed once).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from mortal.controller import conditions as rl
from mortal.controller.status import Condition

DEADLINES = "DeadlinesMet"
REASONS = {
    "task": "TaskDeadlineExceeded",
    "step": "StepDeadlineExceeded",
    "weight-load": "WeightLoadDeadlineExceeded",
}
STALL_REASONS = frozenset(REASONS.values())


@dataclass(frozen=True)
class Deadlines:
    """The spec's deadlines (None: derived) and what a derived one must not go below."""

    task_seconds: float | None = None  # spec.deadlines.taskSeconds
    step_seconds: float | None = None  # spec.deadlines.stepSeconds
    weight_load_seconds: float = 600.0  # spec.deadlines.weightLoadSeconds, its default filled in
    reward_seconds: float = 0.0  # the sum of rewards[].timeoutSeconds: a task's derived deadline is above it


@dataclass(frozen=True)
class DerivedFrom:
    """How derived deadlines follow the run's step times (the progress deadline's settings, PlanConfig)."""

    minimum: float
    factor: float
    before_first_step: float


@dataclass(frozen=True)
class Stall:
    """A worker past the deadline of what it reported doing."""

    reason: str  # TaskDeadlineExceeded | StepDeadlineExceeded | WeightLoadDeadlineExceeded
    message: str  # what, for how long, and the deadline


def deadline(kind: str, spec: Deadlines, step_seconds: float | None, derived: DerivedFrom) -> float | None:
    """Seconds an activity of `kind` may last; None for a kind that has none."""
    if kind == "weight-load":
        return spec.weight_load_seconds
    if kind not in ("task", "step"):
        return None
    base = rl.progress_deadline(step_seconds, derived.minimum, derived.factor, derived.before_first_step)
    task = (
        spec.task_seconds
        if spec.task_seconds is not None
        else max(base, spec.reward_seconds + derived.minimum)
    )
    if kind == "task":
        return task
    return spec.step_seconds if spec.step_seconds is not None else max(base, 2 * task)


def stalled(
    activity: str | None,
    since: datetime | None,
    now: datetime,
    spec: Deadlines,
    step_seconds: float | None,
    derived: DerivedFrom,
) -> Stall | None:
    """The stall of a worker reporting `activity` since `since`, or None while it is within its deadline."""
    if activity is None or since is None:
        return None
    kind = activity.split(" ", 1)[0]
    limit = deadline(kind, spec, step_seconds, derived)
    if limit is None:
        return None
    lasted = (now - since).total_seconds()
    if lasted <= limit:
        return None
    return Stall(REASONS[kind], f"{activity} has run {lasted:.0f} s, past its deadline of {limit:g} s")


def due_in(
    activity: str | None,
    since: datetime | None,
    now: datetime,
    spec: Deadlines,
    step_seconds: float | None,
    derived: DerivedFrom,
) -> float | None:
    """Seconds until the activity reaches its deadline (for the pass's requeue), None without one."""
    if activity is None or since is None:
        return None
    limit = deadline(activity.split(" ", 1)[0], spec, step_seconds, derived)
    return None if limit is None else max(0.0, limit - (now - since).total_seconds())


def stall_reason(message: str | None) -> str | None:
    """The stall reason an ended worker's message starts with (the plan writes them so), else None."""
    reason = (message or "").split(":", 1)[0]
    return reason if reason in STALL_REASONS else None


@dataclass(frozen=True)
class StalledWorker:
    """A slot's newest ended worker, ended for a stall; or (`ending`) a running one past its deadline that was
    asked for its stacks and is ended once it answers."""

    name: str  # e.g. rollout-0
    incarnation: int
    message: str  # "<Reason>: <what>"
    ended_at: datetime  # for one still ending: when the stall was seen
    ending: bool = False


def deadlines_met(stalls: list[StalledWorker], last_step_time: datetime | None) -> Condition:
    """False while a worker past its deadline is being ended, or a slot's newest ended worker was relaunched
    for a stall and no step has ended since (the heal is not shown to work yet); True once one has, or when
    nothing ran past its deadline."""
    unhealed = [s for s in stalls if last_step_time is None or last_step_time <= s.ended_at]
    if unhealed:
        newest = max(unhealed, key=lambda s: s.ended_at)
        reason, _, what = newest.message.partition(": ")
        after = (
            "its stacks are asked for, then it is relaunched"
            if newest.ending
            else "relaunched, no step has ended since"
        )
        return Condition(DEADLINES, False, reason, f"{newest.name} #{newest.incarnation}: {what}; {after}")
    if stalls:
        newest = max(stalls, key=lambda s: s.ended_at)
        return Condition(
            DEADLINES,
            True,
            "Healed",
            f"{newest.name} #{newest.incarnation} was relaunched ({newest.message}); steps have ended since",
        )
    return Condition(DEADLINES, True, "WithinDeadlines", "no worker has run past a deadline")
