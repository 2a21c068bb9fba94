"""Rollback and fork under a real controller with simulated workers: a running run is suspended, rolled
back, and resumed from the step it was rolled back to; its status step goes back there first. A fork
of it starts at the parent's step. On SQLite only, as the other lifecycle tests (tests/store_kinds.py).
The same story on a Ray cluster: tests/controller/test_lifecycle_ray.py calls `roll_back_and_fork`."""

from __future__ import annotations

from typing import Any

from realproc import Harness, harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.client.fork import fork_run
from mortal.client.rollback import rollback_run
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only


def test_a_running_run_rolled_back_trains_on_from_the_step_it_went_back_to(harness):  # noqa: F811
    roll_back_and_fork(harness, "wobbly")


def roll_back_and_fork(h: Harness, name: str, spec: dict[str, Any] | None = None) -> None:
    """Run `name` (simulated, 40 steps, `spec` merged in), roll it back from step >= 8 to 4 while it runs, see
    it finish from there with every step's metrics, then fork its last checkpoint into a 4-step longer run."""
    h.apply(
        simulated_run(
            name,
            max_steps=40,
            step_seconds=0.1,
            spec={"checkpoint": {"every": 2, "keep": 10}, **(spec or {})},
        )
    )
    h.start()
    wait_for(lambda: (h.status(name).get("step") or 0) >= 8, 60, "a few steps")

    done = rollback_run(h.store, name, 4, stop_timeout=30)
    assert h.status(name)["step"] < 8  # the controller wrote the status of step 4 before the resume
    assert done.resumed and done.later and min(done.later) == 6 and done.kept_in is not None
    events = [e.reason for e in h.store.list_events(name, limit=200)]
    assert "RolledBack" in events and events.index("RolledBack") > events.index("Suspended")
    actors = [w for w in h.store.list_workers(name) if w.role == "actor"]
    wait_for(
        lambda: len([w for w in h.store.list_workers(name) if w.role == "actor"]) > len(actors),
        30,
        "a new actor",
    )
    final = h.wait_phase(name, "Succeeded", timeout=90)
    newest = [w for w in h.store.list_workers(name) if w.role == "actor"][-1]
    assert h.resumed_from(name, newest.incarnation) == 4
    assert final["step"] == 40
    steps = sorted({m.step for m in h.store.list_metrics(name)})
    assert steps == list(range(1, 41))
    wait_for(lambda: not worker_processes(h.home, run=name), 30, "every worker to exit")

    forked = fork_run(h.store, name, 40, f"{name}-more", sets=["spec.algorithm.maxSteps=44"])
    assert forked.step == 40
    final = h.wait_phase(f"{name}-more", "Succeeded", timeout=60)
    assert final["step"] == 44 and sorted({m.step for m in h.store.list_metrics(f"{name}-more")}) == [
        41,
        42,
        43,
        44,
    ]
    wait_for(lambda: not worker_processes(h.home), 30, "every worker to exit")
