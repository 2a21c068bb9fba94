"""Errors a workload raises to tell the runtime how the worker ended.

Raised by workloads (actor, rollout, rewards, datasets, simulated); read only by
mortal.workers.main, which turns them into the worker's exit code and its report in the store.
"""

from __future__ import annotations


class FatalWorkerError(Exception):
    """The run cannot succeed (bad reward path, reward raised, unreadable dataset, bad model).

    The runtime records `"{reason}: {message}"` with report_exit and exits 3 (EXIT_FATAL); the
    controller fails the run at once instead of relaunching. `reason` is CamelCase, machine-readable
    (e.g. RewardFailed); `message` says what happened and how to fix it.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class ServiceOutage(Exception):
    """A service the worker needs cannot be reached (an environment server down): neither the user's code
    failing nor the model's doing. Raised through rewards and tools alike, it ends the worker as a crash:
    relaunched under restartPolicy and its task done again by the next worker, never the run failed at once
    (FatalWorkerError) nor an error message the model would be trained on."""


def exception_text(exc: BaseException) -> str:
    """What the model reads of an exception a user's tool or environment raised: its message, else its type's
    name; an exception whose own __str__ raises (the user's code too) is named by its type."""
    try:
        return str(exc) or type(exc).__name__
    except Exception:
        return f"{type(exc).__name__} (its message could not be made: its __str__ raised)"
