"""Runs trained by a controller in the test process on the Ray cluster of tests/raycluster.py, for the
tests that kill a node under them (test_exact_resume_ray.py, test_no_shared_fs_ray.py)."""

from __future__ import annotations

from pathlib import Path

from mortal.controller.backends import select_backend
from mortal.controller.manager import Controller
from mortal.controller.observed import PlanConfig
from mortal.controller.reconciler import ControllerConfig
from mortal.state import Store

HERE = Path(__file__).parent
# Worker environment the spec hands over by name (spec.secrets): the test's reward module, one torch thread.
HANDED = {
    "PYTHONPATH": str(HERE),
    "MORTAL_THREADS": "1",
    "WANDB_MODE": "disabled",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}
CONFIG = ControllerConfig(
    plan=PlanConfig(launch_grace_seconds=5.0, active_resync_seconds=0.5),
    worker_lease_seconds=10.0,
    poll_seconds=0.25,
    retry_base_seconds=0.2,
    retry_max_seconds=5.0,
)


def hand_over(monkeypatch) -> None:
    """Put HANDED into this process's environment, from which the controller hands it to the workers."""
    for key, value in HANDED.items():
        monkeypatch.setenv(key, value)


def leave_cluster_as_found(controller: Controller, store: Store, ray_cluster, killed: str | None) -> None:
    """After a test, pass or fail: the controller stopped, no worker of ours left in the cluster, the killed
    node back (the cluster is shared by the session's tests), the store closed."""
    controller.stop()
    backend = select_backend("ray")
    for worker in backend.list():
        backend.stop(worker.handle, grace_seconds=0)
    if killed is not None:
        ray_cluster.add_node(killed)
    store.close()
