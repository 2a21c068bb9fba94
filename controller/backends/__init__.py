"""Backends launch, list and stop worker processes; see base.py for the contract."""

from mortal.controller.backends.base import (
    Backend,
    BackendError,
    BackendNotBuilt,
    BackendUnavailable,
    BackendWorker,
    InsufficientGPUs,
    LaunchFailed,
    UnknownBackend,
    WorkerLaunch,
    select_backend,
)

__all__ = [
    "Backend",
    "BackendError",
    "BackendNotBuilt",
    "BackendUnavailable",
    "BackendWorker",
    "InsufficientGPUs",
    "LaunchFailed",
    "UnknownBackend",
    "WorkerLaunch",
    "select_backend",
]
