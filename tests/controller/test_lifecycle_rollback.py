"""Rollback and fork under a real controller with simulated workers: a running run is suspended, rolled
back, and resumed from the step it was rolled back to; its status step goes back there first. A fork
of it starts at the parent's step. On SQLite only, as the other lifecycle tests (tests/store_kinds.py)."""

from __future__ import annotations

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.controller.cli.fork import fork_run, rollback_run
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only


def test_a_running_run_rolled_back_trains_on_from_the_step_it_went_back_to(harness):  # noqa: F811
    h = harness
    name = "wobbly"
    h.apply(simulated_run(name, max_steps=40, step_seconds=0.1, spec={"checkpoint": {"every": 2, "keep": 10}}))
    h.start()
    wait_for(lambda: (h.status(name).get("step") or 0) >= 8, 30, "a few steps")

    done = rollback_run(h.store, name, 4, stop_timeout=30)
    assert h.status(name)["step"] < 8  # the controller wrote the status of step 4 before the resume
    assert done.resumed and done.later and min(done.later) == 6 and done.kept_in is not None
    events = [e.reason for e in h.store.list_events(name, limit=200)]
    assert "RolledBack" in events and events.index("RolledBack") > events.index("Suspended")
    actors = [w for w in h.store.list_workers(name) if w.role == "actor"]
    wait_for(lambda: len([w for w in h.store.list_workers(name) if w.role == "actor"]) > len(actors), 20,
             "a new actor")
    final = h.wait_phase(name, "Succeeded", timeout=60)
    newest = [w for w in h.store.list_workers(name) if w.role == "actor"][-1]
    assert h.resumed_from(name, newest.incarnation) == 4
    assert final["step"] == 40
    steps = sorted({m.step for m in h.store.list_metrics(name)})
    assert steps == list(range(1, 41))
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")

    forked = fork_run(h.store, name, 40, "wobbly-more", sets=["spec.algorithm.maxSteps=44"])
    assert forked.step == 40
    final = h.wait_phase("wobbly-more", "Succeeded", timeout=30)
    assert final["step"] == 44 and sorted({m.step for m in h.store.list_metrics("wobbly-more")}) == [41, 42, 43, 44]
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")
