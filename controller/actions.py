"""The actions a reconcile pass may take, as small frozen values: `plan()` makes them, the reconciler
applies them.

Each action carries the event to record once it has been applied, so the wording of every event is
decided in the pure planner and tested there. Applying an action twice must be harmless: that is
what lets a controller killed between two actions converge when it (or another one) comes back.
This module holds data only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NORMAL = "Normal"
WARNING = "Warning"


@dataclass(frozen=True)
class Event:
    """One line of `describe`'s event list (type Normal | Warning, CamelCase reason)."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class Launch:
    """Start slot (role, replica): intent row, backend launch, handle recorded, in that order."""

    role: str
    replica: int
    restart: bool
    event: Event
    env: Mapping[str, str] = field(default_factory=dict)  # the controller's memory choices (specs.memory)


@dataclass(frozen=True)
class Adopt:
    """A process launched for worker row `worker_id` whose handle was never recorded: record it."""

    worker_id: int
    handle: str
    event: Event


@dataclass(frozen=True)
class EndWorker:
    """Close a worker row: Succeeded | Failed | Lost | Stopped (later writes of that incarnation are fenced).

    The same store call (`end_worker`) queues again the tasks that incarnation still had leased, so a
    lost rollout's work is taken up at once rather than when its task lease runs out."""

    worker_id: int
    state: str
    exit_code: int | None
    message: str
    event: Event | None


@dataclass(frozen=True)
class Stop:
    """Ask the backend to stop a process (TERM, then KILL after `grace_seconds`; 0 kills at once)."""

    handle: str
    grace_seconds: float
    event: Event | None


@dataclass(frozen=True)
class DumpStacks:
    """Ask a stalled worker for its Python stacks (into its log) before it is ended and stopped: its backend
    signals the process where it can (the worker writes them at once), and the request is recorded in the
    store (`request_stacks`: written, or asked), which the worker's heartbeat answers on every backend.
    Applied before every other action of the pass; a later pass ends the worker once it answered, or
    waited long enough (PlanConfig.stacks_answer_seconds)."""

    handle: str
    worker_id: int


@dataclass(frozen=True)
class Purge:
    """Every worker is gone and the run is being deleted: remove its rows (and files with --purge)."""

    remove_files: bool


Action = Launch | Adopt | EndWorker | Stop | DumpStacks | Purge
