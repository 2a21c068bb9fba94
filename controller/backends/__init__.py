"""Backends launch, list and stop worker processes; see base.py for the contract."""

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
    select_backend,
)

__all__ = [
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
