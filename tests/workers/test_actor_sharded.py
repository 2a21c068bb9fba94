"""actor.count: 2 (issue 19, CPU): the actor worker trains with FSDP2 over 2 ranks (gloo), rank 0 alone
talking to the store. The actor runs as the local backend runs it (`python -m mortal.workers.main`, which
spawns rank 1), the real rollout worker in a thread of this test; a tiny random-init model, on-policy, so
both runs of a pair get the same rollouts.

- one sharded step equals one unsharded step: TRL's logged grad norm (the norm of the whole gradient,
  which FSDP computes from the shards) and loss, and the published weights (gathered by rank 0);
- a sharded checkpoint (torch.distributed.checkpoint) resumes: a run stopped after step 2 and resumed
  ends where an uninterrupted sharded run ends;
- a rank killed mid-run makes the worker exit 75 with the rank named (the controller relaunches it).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from actor_helpers import RolloutThread, actor_spec, create_run
from rollout_helpers import assets_available, make_tiny_model

from mortal.state.store import Store, WorkerRef
from mortal.workers.checkpoint import is_complete, read_marker
from mortal.workers.weights import read_published

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
HERE = Path(__file__).resolve().parent
DEADLINE = 240.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sharded") / "model")


def launch_actor(store: Store, run, home: Path) -> tuple[WorkerRef, subprocess.Popen]:
    """The actor slot's next incarnation, started as the local backend starts a worker."""
    row = store.create_worker(run.name, "actor", 0, "local", lease_seconds=60.0)
    ref = WorkerRef(run=run.name, role="actor", replica=0, incarnation=row.incarnation)
    env = {**os.environ, "MORTAL_RUN": run.name, "MORTAL_ROLE": "actor", "MORTAL_REPLICA": "0",
           "MORTAL_INCARNATION": str(row.incarnation), "MORTAL_HOME": str(home), "MORTAL_THREADS": "2",
           "MORTAL_STATE_URL": f"sqlite:///{home / 'state.db'}", "MORTAL_WORKER_ID": ref.id, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    log = open(home / f"{run.name}-actor-{row.incarnation}.log", "ab")  # noqa: SIM115 - closed with the process
    return ref, subprocess.Popen([sys.executable, "-m", "mortal.workers.main"], env=env, stdout=log, stderr=log)


def train(store: Store, run, home: Path, stop_after: int | None = None) -> int:
    """Run the actor process with a rollout thread to its end (SIGTERM once it reports `stop_after`)."""
    ref, proc = launch_actor(store, run, home)
    with RolloutThread(store, run):
        deadline = time.monotonic() + DEADLINE
        while proc.poll() is None:
            assert time.monotonic() < deadline, _log_tail(home, run.name)
            if stop_after is not None and _reported_step(store, ref) >= stop_after:
                proc.send_signal(signal.SIGTERM)
                stop_after = None
            time.sleep(0.1)
    return proc.returncode


def _reported_step(store: Store, ref: WorkerRef) -> int:
    rows = [r for r in store.list_workers(ref.run) if r.incarnation == ref.incarnation]
    return (rows[0].step or 0) if rows else 0


def _log_tail(home: Path, name: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(home.glob(f"{name}-actor-*.log")))


def _step_metrics(store: Store, name: str, step: int) -> dict[str, float]:
    return {m.name: m.value for m in store.list_metrics(name) if m.step == step}


def test_one_sharded_step_equals_one_unsharded_step(sqlite_store, mortal_home: Path, tiny_dir: Path) -> None:
    algorithm = {"maxSteps": 1, "batchSize": 8}
    whole = create_run(sqlite_store, "whole", actor_spec(str(tiny_dir), algorithm=algorithm))
    split = create_run(sqlite_store, "split", actor_spec(str(tiny_dir), algorithm=algorithm, actor={"count": 2}))
    assert train(sqlite_store, whole, mortal_home) == 0, _log_tail(mortal_home, "whole")
    assert train(sqlite_store, split, mortal_home) == 0, _log_tail(mortal_home, "split")
    held, total = map(int, re.search(r"rank 0 of 2 holds (\d+) of the model's (\d+) weights", _log_tail(
        mortal_home, "split")).groups())
    assert abs(held - total / 2) < total / 100, (held, total)  # sharded: each rank holds its half
    a, b = _step_metrics(sqlite_store, "whole", 1), _step_metrics(sqlite_store, "split", 1)
    assert a["completion_tokens"] == b["completion_tokens"]  # the same rollouts
    assert a["grad_norm"] > 0
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (a["loss"], b["loss"])
    wa = read_published(sqlite_store.latest_weights("whole").path)
    wb = read_published(sqlite_store.latest_weights("split").path)
    assert wa.keys() == wb.keys()
    start = read_published(sqlite_store.list_weights("split")[0].path)  # v0: the weights rank 0 started from
    moved = max(float((wb[k] - start[k]).abs().max()) for k in wb)
    # AdamW's first step moves each weight by about learningRate (1e-2) in its gradient's sign: a rank's
    # half of the batch left out or counted twice would move many weights the other way
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert moved > 5e-3 and worst < 1e-4, (moved, worst)


def test_a_sharded_checkpoint_resumes_where_the_run_would_have_gone(sqlite_store, mortal_home: Path,
                                                                    tiny_dir: Path) -> None:
    spec = {"algorithm": {"maxSteps": 3, "batchSize": 8}, "actor": {"count": 2}, "checkpoint": {"every": 2, "keep": 2}}
    straight = create_run(sqlite_store, "straight", actor_spec(str(tiny_dir), **spec))
    assert train(sqlite_store, straight, mortal_home) == 0, _log_tail(mortal_home, "straight")
    resumed = create_run(sqlite_store, "resumed", actor_spec(str(tiny_dir), **spec))
    assert train(sqlite_store, resumed, mortal_home, stop_after=1) == 0, _log_tail(mortal_home, "resumed")
    [first] = sqlite_store.list_checkpoints("resumed")
    assert first.step in (1, 2) and is_complete(first.path), first
    assert read_marker(first.path)["ranks"] == 2 and (Path(first.path) / "dcp" / ".metadata").is_file()
    assert train(sqlite_store, resumed, mortal_home) == 0, _log_tail(mortal_home, "resumed")
    assert "resuming from" in _log_tail(mortal_home, "resumed")
    a = read_published(sqlite_store.latest_weights("straight").path)
    b = read_published(sqlite_store.latest_weights("resumed").path)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst
    assert json.loads((Path(sqlite_store.list_checkpoints("resumed")[-1].path) / "trainer_state.json")
                      .read_text())["global_step"] == 3


def test_a_rank_killed_mid_run_makes_the_worker_exit_retryable(sqlite_store, mortal_home: Path,
                                                               tiny_dir: Path) -> None:
    run = create_run(sqlite_store, "killed", actor_spec(str(tiny_dir), algorithm={"maxSteps": 50, "batchSize": 8},
                                                        actor={"count": 2}))
    ref, proc = launch_actor(sqlite_store, run, mortal_home)
    with RolloutThread(sqlite_store, run):
        deadline = time.monotonic() + DEADLINE
        while _reported_step(sqlite_store, ref) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, _log_tail(mortal_home, "killed")
            time.sleep(0.1)
        [rank1] = [c for c in psutil.Process(proc.pid).children()
                   if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        rank1.kill()
        assert proc.wait(timeout=60) == 75, _log_tail(mortal_home, "killed")
    [row] = [r for r in sqlite_store.list_workers("killed") if r.incarnation == ref.incarnation]
    assert (row.state, row.exit_code) == ("Failed", 75) and "actor rank 1 of 2 ended" in (row.message or ""), row
