"""Exactly once across async resume: a maxStaleness 1 run whose actor, a rollout and the controller are
each killed (kill -9) at a random point still trains every row of its epoch exactly once, each step on
samples at most one version older than the weights it trains, from weights its own lineage published,
and no weight version is published twice.

What is checked is what the model trained: the simulated actor's lineage, carried in every checkpoint
(mortal.workers.simulated.Lineage), not the task queue's rows, which a resume rewrites. A seeded random
schedule rather than hypothesis: each example is a run of real processes (seconds, not microseconds), and
what varies is when and in which order the kills land, which a seed replays (MORTAL_EXACTLY_ONCE_SEEDS).
On both SQL stores: the task leases, resets and weight records are theirs (tests/store_kinds.py)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from pathlib import Path

import psutil
import pytest
from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sql_stores

from mortal.controller.ledger import run_ledger
from mortal.workers import schedule
from mortal.workers.simulated import SIMULATED_ROWS, STATE_FILE, simulated_run

PROMPTS_PER_STEP = 2
STEPS = SIMULATED_ROWS // PROMPTS_PER_STEP  # one epoch: every row once
STEP_SECONDS = 0.4  # slow enough that the run outlives a controller's restart (its lease) and every kill
LAST_KILL_AT = 14  # steps: a restarted controller waits out its predecessor's lease while training goes on
SEEDS = [int(s) for s in os.environ.get("MORTAL_EXACTLY_ONCE_SEEDS", "11,23").split(",")]
VICTIMS = ("actor", "rollout", "controller")

pytestmark = [sql_stores, pytest.mark.slow]


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, psutil.Error):
        os.killpg(pid, signal.SIGKILL)


def step_of(h, name: str) -> int:
    return h.status(name).get("step") or 0


def story(h, name: str) -> str:
    """What happened to the run, for a failure's message."""
    events = [f"{e.reason}: {e.message}" for e in h.store.list_events(name, limit=40)]
    return "\n".join([str(h.status(name)), *events])


@pytest.mark.parametrize("seed", SEEDS)
def test_kills_at_random_points_train_every_row_exactly_once(harness, seed):  # noqa: F811
    h, rng, name = harness, random.Random(seed), f"once-{seed}"
    h.apply(
        simulated_run(
            name,
            max_steps=STEPS,
            rollout_replicas=2,
            step_seconds=STEP_SECONDS,
            spec={
                "algorithm": {"batchSize": PROMPTS_PER_STEP * 2, "maxStaleness": 1},
                "restartPolicy": {"maxRestarts": 100, "backoffSeconds": 0.2},
            },
            annotations={"mortal.dev/generate-seconds": "0.02", "mortal.dev/task-lease-seconds": "2"},
        )
    )
    controller = h.spawn()
    order = rng.sample(VICTIMS, len(VICTIMS))
    at_steps = sorted(rng.sample(range(2, LAST_KILL_AT), len(order)))
    for victim, at in zip(order, at_steps, strict=True):
        wait_for(lambda at=at: step_of(h, name) >= at, 90, f"step {at} before killing the {victim}")
        if victim == "controller":
            kill_group(controller.pid)
            controller.wait()
            controller = h.spawn()
        else:
            targets = wait_for(
                lambda v=victim: worker_processes(h.home, role=v),
                30,
                f"a live {victim}",
                details=lambda: story(h, name),
            )
            kill_group(rng.choice(targets).pid)
    wait_for(
        lambda: h.status(name).get("phase") == "Succeeded",
        120,
        f"{name} Succeeded",
        details=lambda: story(h, name),
    )
    final = h.status(name)
    assert final["step"] == STEPS and final["restarts"] >= 2, final  # the actor's and the rollout's kills

    ckpt = h.store.latest_checkpoint(name)
    lineage = json.loads((Path(ckpt.path) / STATE_FILE).read_text())
    steps, published = lineage["steps"], lineage["published"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), "a step trained twice or never"
    for s in steps:
        wanted = schedule.prompt_slots(0, s["step"] - 1, PROMPTS_PER_STEP, SIMULATED_ROWS)
        assert s["rows"] == [f"row {r}" for r in wanted], s
        for version in s["versions"]:  # maxStaleness 1, and weights of this lineage (0: the base model)
            assert s["trainedWith"] - 1 <= version <= s["trainedWith"], s
            assert version == 0 or version in published, (s, published)
    rows = sorted(int(r.split()[1]) for s in steps for r in s["rows"])
    assert rows == list(range(SIMULATED_ROWS)), "every row of the epoch exactly once"
    assert published == sorted(set(published)), "a weight version published twice in the lineage"
    assert h.store.latest_weights(name).version == published[-1]

    ledger = run_ledger(h.store, h.store.get_run(name))
    assert (ledger.steps, ledger.prompts_drawn, ledger.tasks_done) == (STEPS, SIMULATED_ROWS, SIMULATED_ROWS)
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")
