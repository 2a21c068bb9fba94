"""The simulated workload: a whole run through the real protocol, resume after kill -9, rollout loss.
The worker processes run on SQLite only: they are the subject, not the store (tests/store_kinds.py)."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_helpers import SimCluster, Started
from store_kinds import sqlite_only

from mortal.state import TaskRow, paths
from mortal.workers.errors import FatalWorkerError
from mortal.workers.messages import RolloutResult
from mortal.workers.simulated import Settings, simulated_result, simulated_reward, simulated_run


@pytest.fixture
def cluster(store_url: str, mortal_home: Path) -> Iterator[SimCluster]:
    c = SimCluster(store_url, mortal_home)
    yield c
    c.close()


def kill9(started: Started) -> None:
    os.killpg(int(started.handle.split(":")[0]), signal.SIGKILL)


def rewards_by_step(cluster: SimCluster, run: str) -> dict[int, float]:
    return {m.step: m.value for m in cluster.store.list_metrics(run, name="reward")}


@sqlite_only
def test_actor_and_rollout_complete_a_run(cluster: SimCluster) -> None:
    run = cluster.apply(
        simulated_run(
            "full",
            max_steps=5,
            rollout_replicas=1,
            spec={
                "rewards": [{"function": "m:a", "weight": 1.0}, {"function": "m:b", "weight": 0.5}],
            },
        )
    )
    actor, rollout = cluster.start(run.name, "actor"), cluster.start(run.name, "rollout")
    assert cluster.wait_exit(actor) == 0
    assert cluster.row(actor).state == "Succeeded"

    assert rewards_by_step(cluster, "full") == pytest.approx(
        {s: 1.5 * simulated_reward(s) for s in range(1, 6)}
    )
    assert [w.version for w in cluster.store.list_weights("full")] == [3, 4, 5]
    checkpoints = cluster.store.list_checkpoints("full")
    assert [c.step for c in checkpoints] == [4, 5], "every 2 steps and at the end, keep 2"
    on_disk = sorted(p.name for p in paths.checkpoints_dir("full").iterdir())
    assert on_disk == sorted(Path(c.path).name for c in checkpoints), "retired checkpoints are deleted"
    assert sorted(p.name for p in paths.weights_dir("full").iterdir()) == ["v3-i1", "v4-i1", "v5-i1"]
    tasks = [t for s in range(1, 6) for t in cluster.store.step_results("full", s)]
    assert len(tasks) == 5 * 2 and {t.lease_holder for t in tasks} == {rollout.ref.id}

    assert cluster.listed(rollout).alive, "a rollout serves until it is told to stop"
    cluster.backend.stop(rollout.handle)
    assert cluster.row(rollout).state == "Running", "stopped on request: no report of its own"

    # the start, in the worker's own log: how long exec and the imports took (the GPU bench's start timeline)
    log = next(paths.run_dir("full").rglob("actor-0-*.log")).read_text()
    assert re.search(r"starting \(pid \d+, CUDA_VISIBLE_DEVICES='.*', \d+\.\d s after exec\)", log)
    assert re.search(
        r"workload mortal\.workers\.simulated imported in \d+\.\d s \(store and context took "
        r"\d+\.\d s\)",
        log,
    )


@sqlite_only
def test_actor_resumes_after_kill_9_and_weight_versions_keep_growing(cluster: SimCluster) -> None:
    run = cluster.apply(simulated_run("resume", max_steps=6, rollout_replicas=0, step_seconds=0.1))
    first = cluster.start(run.name, "actor")
    cluster.wait_step(first, 3)
    kill9(first)
    assert cluster.wait_exit(first) == -signal.SIGKILL
    published = cluster.store.latest_weights("resume").version
    resumed_from = cluster.store.latest_checkpoint("resume").step
    assert published >= 3 and resumed_from >= 2

    second = cluster.start(run.name, "actor")
    assert cluster.wait_exit(second) == 0
    assert rewards_by_step(cluster, "resume") == pytest.approx({s: simulated_reward(s) for s in range(1, 7)})
    versions = [w.version for w in cluster.store.list_weights("resume")]
    # The checkpoint's weights again as a new version, then one per step replayed: never reusing an old
    # number, nor calling the checkpoint's weights by the number of the killed actor's later ones.
    assert versions == sorted(set(versions)) and versions[-1] == published + 1 + (6 - resumed_from)
    log = paths.worker_log("resume", "actor", 0, second.ref.incarnation).read_text()
    assert "resuming from checkpoint" in log


@sqlite_only
def test_a_killed_rollout_loses_no_task(cluster: SimCluster) -> None:
    run = cluster.apply(
        simulated_run(
            "lossless",
            max_steps=8,
            rollout_replicas=1,
            step_seconds=0.05,
            annotations={"mortal.dev/task-lease-seconds": "1", "mortal.dev/generate-seconds": "0.05"},
        )
    )
    actor, rollout = cluster.start(run.name, "actor"), cluster.start(run.name, "rollout")
    cluster.wait_step(actor, 2)
    kill9(rollout)
    cluster.wait_exit(rollout)
    replacement = cluster.start(run.name, "rollout")

    assert cluster.wait_exit(actor, timeout=60) == 0
    assert sorted(rewards_by_step(cluster, "lossless")) == list(range(1, 9))
    holders = {t.lease_holder for s in range(1, 9) for t in cluster.store.step_results("lossless", s)}
    assert replacement.ref.id in holders
    cluster.backend.stop(replacement.handle)


# -- in-process --------------------------------------------------------------------------------
def test_simulated_result_is_a_rollout_result() -> None:
    run = simulated_run("shape", spec={"rewards": [{"function": "m:f"}, {"env": "math-answer"}]})
    task = TaskRow(
        run="shape",
        step=3,
        slot=1,
        min_weight_version=2,
        payload={"prompt": "p", "num_generations": 2, "seed": 1},
    )
    result = RolloutResult.model_validate(simulated_result(run, task, 5, 0.01))
    assert result.weight_version == 5 and len(result.completion_ids) == 2
    assert result.rewards == {"f": [simulated_reward(3)] * 2, "math-answer": [simulated_reward(3)] * 2}


def test_settings_from_annotations() -> None:
    run = simulated_run("s", step_seconds=0.3, annotations={"mortal.dev/fail": "always"})
    assert Settings.of(run) == Settings(step_seconds=0.3, fail="always")
    with pytest.raises(FatalWorkerError, match="InvalidAnnotation"):
        Settings.of(simulated_run("s", annotations={"mortal.dev/generate-seconds": "fast"}))
