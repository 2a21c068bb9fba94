"""Build a run's status block from what one pass saw: phase, progress, replicas, restarts, conditions.

Called only by `plan` (which decides the phase); the reconciler writes the result once. Status is
rebuilt from the world every pass, never accumulated: the previous status is read only to keep
times stable (a condition's lastTransitionTime, startTime, completionTime) and to notice what changed
(the events for a phase change, a new checkpoint, a scale). Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from mortal.controller.actions import NORMAL, WARNING, Event
from mortal.specs import TERMINAL_PHASES, TRANSITIONS, Phase

PENDING, STARTING, RUNNING, RECOVERING = "Pending", "Starting", "Running", "Recovering"
SUSPENDED, SUCCEEDED, FAILED = "Suspended", "Succeeded", "Failed"
EVENTED = (
    "WeightsInSync",
    "RewardHealthy",
    "CheckpointFresh",
    "Progressing",
    "DeadlinesMet",
    "MemoryFits",
)  # flips are events


@dataclass(frozen=True)
class Condition:
    """A condition as the planner wants it now; `build_status` keeps its transition time if unchanged."""

    type: str
    status: bool | None  # None: Unknown (not evaluated now, or nothing to judge yet)
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Progress:
    """Numbers read off the world for the status block."""

    step: int | None
    weight_version: int | None
    checkpoint: dict[str, Any] | None
    reward: float | None
    actor: tuple[int, int]  # (ready, desired)
    rollout: tuple[int, int]
    restarts: int
    last_step_time: str | None = None  # when the controller first saw the current step (ISO)
    step_seconds: float | None = None  # median duration of the recent steps
    active_seconds: float = 0.0  # active time before active_since (mortal.controller.budgets)
    active_since: str | None = None  # when the current active period began (ISO); None while not active
    gpu_hours: float = 0.0  # GPU time of every worker of the run


def legal_phase(prev: str, wanted: str) -> str:
    """`wanted` if Phase's table allows prev -> wanted, else the first hop of the shortest legal path.

    Status is rebuilt from the world, so a pass may see a run two transitions ahead of its last
    written phase (a controller that was down): it writes the hop and asks to be requeued at once.
    """
    start, goal = Phase(prev), Phase(wanted)
    if start.can_become(goal):
        return wanted
    paths = [[nxt] for nxt in sorted(start.allowed_next())]
    seen = {start, *(path[0] for path in paths)}
    while paths:
        path = paths.pop(0)
        if path[-1] == goal:
            return str(path[0])
        for nxt in sorted(TRANSITIONS[path[-1]] - seen):
            seen.add(nxt)
            paths.append([*path, nxt])
    return prev  # unreachable (terminal start): stay


def iso(moment: datetime) -> str:
    return moment.isoformat()


def build_status(
    prev: Mapping[str, Any],
    phase: str,
    conditions: list[Condition],
    progress: Progress,
    generation: int,
    message: str,
    now: datetime,
    effective: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole status block (camelCase, JSON-able) in the shape mortal.specs' status model reads."""
    started = prev.get("startTime") or (iso(now) if phase not in (PENDING,) else None)
    completed = prev.get("completionTime") if prev.get("phase") in TERMINAL_PHASES else None
    if phase in TERMINAL_PHASES and completed is None:
        completed = iso(now)
    return {
        "phase": phase,
        "observedGeneration": generation,
        "step": progress.step if progress.step is not None else prev.get("step"),
        "weightVersion": progress.weight_version
        if progress.weight_version is not None
        else prev.get("weightVersion"),
        "lastCheckpoint": progress.checkpoint or prev.get("lastCheckpoint"),
        "replicas": {
            "actor": {"ready": progress.actor[0], "desired": progress.actor[1]},
            "rollout": {"ready": progress.rollout[0], "desired": progress.rollout[1]},
        },
        "restarts": progress.restarts,
        "reward": progress.reward if progress.reward is not None else prev.get("reward"),
        "conditions": _merge_conditions(prev.get("conditions") or [], conditions, now),
        "lastStepTime": progress.last_step_time,
        "stepSeconds": progress.step_seconds,
        "startTime": started,
        "activeSeconds": progress.active_seconds,
        "activeSince": progress.active_since,
        "gpuHours": progress.gpu_hours,
        "completionTime": completed,
        "message": message,
        **({"effective": effective} if effective else {}),  # the controller's memory choices (heal.py)
    }


def _merge_conditions(
    prev: list[dict[str, Any]], wanted: list[Condition], now: datetime
) -> list[dict[str, Any]]:
    """Conditions in `wanted` order; lastTransitionTime moves only when a condition's status flips."""
    before = {c.get("type"): c for c in prev}
    merged = []
    for cond in wanted:
        status = condition_status(cond.status)
        old = before.get(cond.type)
        moved = old is None or old.get("status") != status
        merged.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": iso(now)
                if moved or old is None
                else old.get("lastTransitionTime", iso(now)),
            }
        )
    return merged


def condition_status(value: bool | None) -> str:
    return "Unknown" if value is None else "True" if value else "False"


def diff_events(prev: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for what changed between two status blocks: phase, newest checkpoint, rollout scale, and
    each training condition (`EVENTED`) turning False (Warning) or True (Normal) from False or Unknown."""
    events: list[Event] = []
    old_phase, phase = prev.get("phase") or PENDING, new["phase"]
    if old_phase != phase:
        kind = WARNING if phase in (RECOVERING, FAILED) else NORMAL
        why = f": {new['message']}" if new.get("message") else ""
        events.append(Event(kind, phase, f"phase {old_phase} -> {phase}{why}"))
    old_ckpt, ckpt = prev.get("lastCheckpoint") or {}, new.get("lastCheckpoint") or {}
    if ckpt and ckpt.get("step") != old_ckpt.get("step"):
        events.append(
            Event(NORMAL, "CheckpointSaved", f"checkpoint of step {ckpt['step']} at {ckpt.get('path')}")
        )
    steady = {STARTING, RUNNING, RECOVERING}
    if old_phase in steady and phase in steady:
        was = ((prev.get("replicas") or {}).get("rollout") or {}).get("desired")
        now_ = new["replicas"]["rollout"]["desired"]
        if was is not None and was != now_:
            events.append(Event(NORMAL, "Scaled", f"rollout replicas {was} -> {now_}"))
    before = {c.get("type"): c.get("status") for c in prev.get("conditions") or []}
    for cond in new.get("conditions") or []:
        if (
            cond["type"] not in EVENTED
            or cond["status"] == before.get(cond["type"])
            or cond["status"] == "Unknown"
        ):
            continue
        if cond["status"] == "True" and before.get(cond["type"]) is None:
            continue  # first seen healthy: nothing happened
        kind = NORMAL if cond["status"] == "True" else WARNING
        events.append(Event(kind, cond["reason"], f"{cond['type']} is {cond['status']}: {cond['message']}"))
    return events
