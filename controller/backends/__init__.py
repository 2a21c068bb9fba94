"""Backends launch, list and stop worker processes; base.py holds the contract, this package the factory.

Who calls it: the controller (`Reconciler`, `Controller`) picks a run's backend with
`select_backend(backend_key(spec))`; tests pass their own factory of the same shape. The factory lives
here, not in base.py, because it imports every backend and every backend imports base.py.
What it must not do: import a backend's third-party package (modal, ray) at import time: each backend
module imports its own package when it is made, so `local` works where neither is installed.

    select_backend("local")                      # processes on this machine
    select_backend("modal")                      # calls of the deployed Modal app
    select_backend("ray")                        # actors on the Ray cluster at $RAY_ADDRESS
    select_backend("ray@10.0.0.5:6379")          # ... at the spec's ray.address (backend_key builds it)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mortal.controller.backends.base import (
    Backend,
    BackendError,
    BackendUnavailable,
    BackendWorker,
    InsufficientGPUs,
    LaunchFailed,
    UnknownBackend,
    Unschedulable,
    WaitingForActorGPU,
    WorkerLaunch,
)

if TYPE_CHECKING:
    from mortal.specs import TrainingSpec

NAMES = ("local", "modal", "ray")
RAY_KEY_SEPARATOR = "@"  # "ray@<address>": a run whose spec names its Ray cluster


def backend_key(spec: TrainingSpec) -> str:
    """Which backend object serves the spec: its `backend` name, with the Ray cluster's address when the
    spec names one (spec.ray.address), so runs on the same cluster share one backend and its listing."""
    if spec.backend == "ray" and spec.ray.address:
        return f"ray{RAY_KEY_SEPARATOR}{spec.ray.address}"
    return spec.backend


def select_backend(name: str) -> Backend:
    """The backend a key of `backend_key` (a spec's `backend:` field) names."""
    if name == "local":
        from mortal.controller.backends.local import LocalBackend

        return LocalBackend()
    if name == "modal":
        from mortal.controller.backends.modal import ModalBackend

        return ModalBackend()
    if name == "ray" or name.startswith("ray" + RAY_KEY_SEPARATOR):
        from mortal.controller.backends.ray import RayBackend

        return RayBackend(address=name.partition(RAY_KEY_SEPARATOR)[2] or None)
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
    "Unschedulable",
    "WaitingForActorGPU",
    "WorkerLaunch",
    "backend_key",
    "select_backend",
]
