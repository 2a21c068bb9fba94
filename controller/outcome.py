"""What a reconcile pass asks of the work queue: the controller-runtime `Result`, as one closed type.

`plan()` returns one of these and `reconciler.reconcile()` passes it on; only the dispatcher in
`mortal.controller.workqueue` interprets it (forget, timer, backoff, drop). Nothing here does I/O,
and nothing else may turn an outcome into a sleep.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Done:
    """Converged: nothing to do until something changes (a spec write or the periodic resync)."""


@dataclass(frozen=True)
class RequeueAfter:
    """Look again after `seconds` (a backoff before a relaunch, a process stopping, a heartbeat check)."""

    seconds: float


@dataclass(frozen=True)
class Retry:
    """A temporary error: requeue with this run's exponential backoff (reset by the next success)."""

    error: str


@dataclass(frozen=True)
class Terminal:
    """An error retrying cannot fix (a stored spec that no longer validates): log it, do not requeue."""

    error: str


Outcome = Done | RequeueAfter | Retry | Terminal
