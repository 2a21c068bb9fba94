"""kill -9 of the actor: Recovering within 5 s, training again within 30 s, resumed from the last
checkpoint, weight version never backwards, exactly one restart, and the run still succeeds.

On every store (SQLite, PostgreSQL, HTTP): the one lifecycle test that takes each store through the
whole controller and its workers (most others run on SQLite only: tests/store_kinds.py)."""

from __future__ import annotations

import os
import signal
import time

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture

from mortal.workers.simulated import simulated_run

NAME = "kill-actor"


def test_actor_kill_recovers_from_the_last_checkpoint(harness):  # noqa: F811
    h = harness
    h.apply(
        simulated_run(
            NAME,
            max_steps=30,
            rollout_replicas=1,
            step_seconds=0.15,
            spec={"restartPolicy": {"backoffSeconds": 1.0, "maxRestarts": 5}},
        )
    )
    h.start()
    wait_for(
        lambda: (h.status(NAME).get("step") or 0) >= 6 and h.status(NAME)["phase"] == "Running",
        30,
        "the actor to train a few steps",
    )
    [actor] = worker_processes(h.home, role="actor")
    weights_seen = [h.store.latest_weights(NAME).version]

    os.killpg(actor.pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_for(
        lambda: h.status(NAME)["phase"] == "Recovering",
        5,
        "phase Recovering within 5 s of the kill",
        interval=0.05,
    )
    ckpt_at_death = h.store.latest_checkpoint(NAME).step

    def training_again():
        weights_seen.append(h.store.latest_weights(NAME).version)
        rows = [w for w in h.store.list_workers(NAME) if w.role == "actor"]
        new = rows[-1]
        return (
            new.incarnation != rows[0].incarnation
            and new.state == "Running"
            and (new.step or 0) > ckpt_at_death
        )

    wait_for(training_again, 30, "the relaunched actor to train past its checkpoint")
    assert time.monotonic() - killed < 30
    actors = [w for w in h.store.list_workers(NAME) if w.role == "actor"]
    assert [w.state for w in actors[:-1]] == ["Lost"]
    assert h.resumed_from(NAME, actors[-1].incarnation) == ckpt_at_death

    final = h.wait_phase(NAME, "Succeeded", timeout=60)
    weights_seen.append(h.store.latest_weights(NAME).version)
    assert weights_seen == sorted(weights_seen), "weight version went backwards"
    assert final["step"] == 30 and final["restarts"] == 1
    reasons = [e.reason for e in h.store.list_events(NAME, limit=200)]
    assert {"WorkerLost", "Restarted", "Recovering"} <= set(reasons)
    wait_for(lambda: not worker_processes(h.home), 20, "the rollout to be stopped")
