"""Backends launch, list and stop worker processes; base.py holds the contract, this package the factory.

Who calls it: the controller (`Reconciler`, `Controller`) picks a run's backend with
`select_backend(spec.backend)`; tests pass their own factory of the same shape. The factory lives
here, not in base.py, because it imports every backend and every backend imports base.py.
What it must not do: import a backend's third-party package (modal) at import time: each backend
module imports its own package when it is made, so `local` works where neither is installed.

    select_backend("local")                      # processes on this machine
    select_backend("modal")                      # calls of the deployed Modal app
"""

from __future__ import annotations

from mortal.controller.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    BackendWorker,
    InsufficientGPUs,
    LaunchFailed,
    UnknownBackend,
    WaitingForActorGPU,
    WorkerLaunch,
)

NAMES = ("local", "modal")


def select_backend(name: str) -> Backend:
    """The backend a spec's `backend:` field names."""
    if name == "local":
        from mortal.controller.backends.local import LocalBackend

        return LocalBackend()
    if name == "modal":
        from mortal.controller.backends.modal import ModalBackend

        return ModalBackend()
    raise UnknownBackend(f"unknown backend {name!r}: use one of {', '.join(NAMES)}")


__all__ = [
    "NAMES",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "BackendWorker",
    "InsufficientGPUs",
    "LaunchFailed",
    "UnknownBackend",
    "WaitingForActorGPU",
    "WorkerLaunch",
    "select_backend",
]
