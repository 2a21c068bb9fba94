"""`scale rollout=3` -> exactly 3 live rollout processes while training continues; back to 1 -> exactly 1.
On SQLite only: scaling is the controller's (tests/store_kinds.py)."""

from __future__ import annotations

from realproc import delete_and_wait, harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.workers.simulated import simulated_run

NAME = "scale"
pytestmark = sqlite_only


def replicas(n: int):
    def change(spec):
        spec["rollout"] = {**spec["rollout"], "replicas": n}

    return change


def test_scale_rollouts_up_and_down_while_training(harness):  # noqa: F811
    h = harness
    h.apply(simulated_run(NAME, max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    h.start()
    h.wait_phase(NAME, "Running")
    actor_pid = worker_processes(h.home, role="actor")[0].pid

    h.change_spec(NAME, replicas(3))
    wait_for(lambda: len(worker_processes(h.home, role="rollout")) == 3, 20, "3 rollout processes")
    wait_for(lambda: h.status(NAME)["replicas"]["rollout"] == {"ready": 3, "desired": 3}, 20, "3 ready")
    step = h.status(NAME)["step"]
    wait_for(lambda: h.status(NAME)["step"] > step + 2, 20, "training to continue at 3 replicas")

    h.change_spec(NAME, replicas(1))
    wait_for(lambda: len(worker_processes(h.home, role="rollout")) == 1, 20, "1 rollout process")
    wait_for(lambda: h.status(NAME)["replicas"]["rollout"] == {"ready": 1, "desired": 1}, 20, "1 ready")
    step = h.status(NAME)["step"]
    wait_for(lambda: h.status(NAME)["step"] > step + 2, 20, "training to continue at 1 replica")

    assert [p.pid for p in worker_processes(h.home, role="actor")] == [actor_pid], "the actor was disturbed"
    assert [w.replica for w in h.live_rows(NAME, "rollout")] == [0]
    assert h.status(NAME)["phase"] == "Running" and h.status(NAME)["restarts"] == 0
    messages = [e.message for e in h.store.list_events(NAME, limit=200) if e.reason == "Scaled"]
    assert messages == ["rollout replicas 1 -> 3", "rollout replicas 3 -> 1"]
    delete_and_wait(h, NAME)
