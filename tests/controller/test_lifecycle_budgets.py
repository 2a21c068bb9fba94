"""spec.limits end to end: a tiny CPU run (the simulated workload, real processes, a real controller) that
reaches maxDuration stops its workers, the actor writes a final checkpoint on its way out, and the run
ends Failed with reason DeadlineExceeded. On SQLite only (tests/store_kinds.py); the planner's side of
every limit is table-tested in test_plan_budgets.py."""

from __future__ import annotations

import re
from pathlib import Path

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.specs import RunStatus
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only


def test_a_run_reaching_max_duration_checkpoints_and_fails_with_deadline_exceeded(harness):  # noqa: F811
    h = harness
    name = "deadline"
    # checkpoints every 1000 steps: the only one it can have is the final one written when it is stopped
    h.apply(
        simulated_run(
            name,
            max_steps=100_000,
            rollout_replicas=1,
            step_seconds=0.1,
            spec={"checkpoint": {"every": 1000, "keep": 2}, "limits": {"maxDuration": "8s"}},
        )
    )
    h.start()
    wait_for(
        lambda: (h.status(name).get("step") or 0) >= 3, 30, "a few steps", details=lambda: str(h.status(name))
    )
    assert h.store.latest_checkpoint(name) is None

    status = h.wait_phase(name, "Failed", timeout=30)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    # the pass that notices the limit comes a little after it (a slow CI machine: seconds): a bound, not a
    # figure
    reached = re.fullmatch(
        r"limits\.maxDuration \(8s\) reached: active for (\d+\.\d)s.*", failed["message"], re.S
    )
    assert reached and 8.0 <= float(reached.group(1)) < 16.0, failed["message"]
    assert worker_processes(h.home, run=name) == []
    assert {w.state for w in h.store.list_workers(name)} == {"Stopped"}

    ckpt = h.store.latest_checkpoint(name)
    assert ckpt is not None and Path(ckpt.path).is_dir() and ckpt.step >= 3
    assert [c.step for c in h.store.list_checkpoints(name)] == [ckpt.step]
    assert status["lastCheckpoint"]["step"] == ckpt.step == status["step"]  # recorded before the run failed
    parsed = RunStatus.model_validate(status)
    assert 8.0 <= parsed.active_seconds < 16.0 and parsed.active_since is None and parsed.gpu_hours == 0.0
    phases = [e.reason for e in h.store.list_events(name, limit=200) if e.message.startswith("phase ")]
    assert phases == ["Starting", "Running", "Failed"]
