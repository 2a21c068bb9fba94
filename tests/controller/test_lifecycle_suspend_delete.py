"""suspend stops every worker and keeps what resuming needs; resume continues from the latest
checkpoint; delete stops every worker, leaves no process and keeps checkpoints unless --purge.
On SQLite only: suspend, resume and delete are the controller's (tests/store_kinds.py); the store's own
delete and purge are in its contract (tests/state/test_store_contract.py)."""

from __future__ import annotations

from pathlib import Path

from realproc import delete_and_wait, harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.state import paths
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only


def suspend(value: bool):
    def change(spec):
        spec["suspend"] = value

    return change


def test_suspend_then_resume_continues_from_the_latest_checkpoint(harness):  # noqa: F811
    h = harness
    name = "pausable"
    h.apply(simulated_run(name, max_steps=30, rollout_replicas=2, step_seconds=0.15))
    h.start()
    wait_for(lambda: (h.status(name).get("step") or 0) >= 5, 30, "a few steps")

    h.change_spec(name, suspend(True))
    status = h.wait_phase(name, "Suspended", timeout=20)
    wait_for(lambda: h.status(name)["message"] == "suspended", 20, "every worker stopped")
    assert worker_processes(h.home) == []
    assert {w.state for w in h.store.list_workers(name)} == {"Stopped"}
    ckpt = h.store.latest_checkpoint(name)
    assert ckpt is not None and Path(ckpt.path).is_dir()
    status = h.status(name)
    assert status["replicas"]["rollout"] == {"ready": 0, "desired": 0}

    h.change_spec(name, suspend(False))
    final = h.wait_phase(name, "Succeeded", timeout=60)
    actors = [w for w in h.store.list_workers(name) if w.role == "actor"]
    assert len(actors) == 2 and h.resumed_from(name, actors[-1].incarnation) == ckpt.step
    assert final["step"] == 30 and final["restarts"] == 0
    phases = [e.reason for e in h.store.list_events(name, limit=200) if e.message.startswith("phase ")]
    assert phases == ["Starting", "Running", "Suspended", "Starting", "Running", "Succeeded"]
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


def test_delete_stops_everything_and_keeps_checkpoints_unless_purged(harness):  # noqa: F811
    h = harness
    for name in ("keep", "purge"):
        h.apply(simulated_run(name, max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    h.start()
    for name in ("keep", "purge"):
        wait_for(lambda n=name: h.store.latest_checkpoint(n), 30, f"{name} to checkpoint")

    uid = h.store.get_run("keep").uid
    delete_and_wait(h, "keep")
    assert worker_processes(h.home, run="keep") == []
    assert any((paths.kept_run_dir("keep", uid) / "checkpoints").iterdir()), (
        "delete without --purge removed them"
    )
    assert not paths.run_dir("keep").exists(), "a run applied again under the name would write among them"
    assert len(worker_processes(h.home, run="purge")) == 2, "deleting one run disturbed another"

    delete_and_wait(h, "purge", purge=True)
    assert not paths.run_dir("purge").exists()
    assert h.store.list_workers() == []
