"""Exact resume through the controller: kill -9 a worker mid-run, the run ends with the same weights.

A controller (`python -m mortal.controller`) runs three copies of one CPU spec (maxStaleness 0)
side by side: one left alone, one whose actor is killed with SIGKILL at a random step after its
first checkpoint, one whose rollout worker is killed the same way. The controller relaunches the
dead worker (the actor resumes from its newest checkpoint; the rollout's leased task is leased
again), every run Succeeds, and the tensors of the final published weights and of the final
checkpoint hash to the same sha256 in all three. The random steps come from MORTAL_TEST_SEED
(printed), so a failure can be replayed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from actor_helpers import SHORT_TASK_LEASE, actor_spec, create_run, final_checkpoint_hash, final_weights_hash
from rollout_helpers import assets_available, make_tiny_model

from mortal.state import Store, open_store

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")]
HERE = Path(__file__).parent
MAX_STEPS, EVERY = 6, 2
DEADLINE_SECONDS = 900


@pytest.fixture
def controller(mortal_home: Path) -> Iterator[tuple[Store, subprocess.Popen[bytes]]]:
    url = f"sqlite:///{mortal_home / 'state.db'}"
    store = open_store(url)
    env = dict(
        os.environ,
        MORTAL_HOME=str(mortal_home),
        MORTAL_STATE_URL=url,
        MORTAL_THREADS="1",
        WANDB_MODE="disabled",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    with open(mortal_home / "controller.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mortal.controller"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        yield store, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        for row in store.list_workers():  # workers outlive a stopped controller by design: end ours
            if row.handle and row.state in ("Pending", "Running"):
                _kill(row.handle)
        store.close()


def _kill(handle: str) -> None:
    import psutil

    pid, _, created = handle.partition(":")
    try:
        proc = psutil.Process(int(pid))
        if abs(proc.create_time() - float(created)) < 0.01:
            proc.kill()
    except (psutil.NoSuchProcess, ValueError):
        pass


def _live(store: Store, run: str, role: str):
    return next(
        (w for w in store.list_workers(run) if w.role == role and w.state == "Running" and w.handle), None
    )


def test_a_run_killed_at_a_random_step_resumes_bit_for_bit(controller, tmp_path: Path) -> None:
    store, proc = controller
    seed = int(os.environ.get("MORTAL_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    # No later than two steps before the end: a rollout killed later may have generated the last step's
    # groups already, and then the run rightly finishes without relaunching it.
    last = MAX_STEPS - 2
    kill_at = {"kill-actor": rng.randint(EVERY, last), "kill-rollout": rng.randint(EVERY, last)}
    print(f"MORTAL_TEST_SEED={seed}: kill steps {kill_at}")
    model = make_tiny_model(tmp_path / "model")
    spec = actor_spec(
        str(model),
        algorithm={"maxSteps": MAX_STEPS, "maxStaleness": 0},
        checkpoint={"every": EVERY, "keep": 3},
        restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
    )
    for name in ("straight", *kill_at):
        create_run(store, name, spec, SHORT_TASK_LEASE)

    killed: dict[str, int] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the controller died"
        phases = {name: store.get_run(name).phase for name in ("straight", *kill_at)}
        assert "Failed" not in phases.values(), (phases, [store.get_run(n).status for n in phases])
        if all(p == "Succeeded" for p in phases.values()) and len(killed) == len(kill_at):
            break
        for name, step in kill_at.items():
            actor = _live(store, name, "actor")
            if (
                name in killed
                or actor is None
                or (actor.step or 0) < step
                or store.latest_checkpoint(name) is None
            ):
                continue
            victim = _live(store, name, "actor" if name == "kill-actor" else "rollout")
            if victim is not None:
                os.kill(int(victim.handle.split(":")[0]), signal.SIGKILL)
                killed[name] = actor.step
        time.sleep(0.2)
    else:
        pytest.fail(f"not done in {DEADLINE_SECONDS} s: {phases}, killed at {killed}")

    print(f"killed at steps {killed}")
    hashes = {name: final_weights_hash(store, name) for name in ("straight", *kill_at)}
    assert set(hashes.values()) == {hashes["straight"]} and hashes["straight"][0] == MAX_STEPS, hashes
    finals = {name: final_checkpoint_hash(store, name, MAX_STEPS) for name in hashes}
    assert len(set(finals.values())) == 1, finals
    for name in kill_at:  # the killed worker really was relaunched
        roles = [w.role for w in store.list_workers(name)]
        victim_role = "actor" if name == "kill-actor" else "rollout"
        assert roles.count(victim_role) >= 2, (name, roles)
