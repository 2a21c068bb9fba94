"""Exact resume on a real Ray cluster: a worker node killed mid-run, and the final weights are bit-equal.

A controller (in this process) runs two copies of one tiny real-model CPU run (maxStaleness 0) on the
three-node cluster of tests/raycluster.py: "straight" with actor and rollout on the head, "node-kill"
with its actor on the head and its rollout on a worker node. After the first checkpoint, that worker
node is SIGKILLed (its raylet and every process under it); the run goes Recovering, its rollout is
relaunched on the other worker node, both runs Succeed, and the tensors of their final published weights
and final checkpoints hash to the same sha256. Runs in `unshare -rn` (scripts/test.sh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from actor_helpers import SHORT_TASK_LEASE, actor_spec, create_run, final_checkpoint_hash, final_weights_hash
from polling import wait_for
from ray_run_helpers import CONFIG, HANDED, hand_over, leave_cluster_as_found
from rollout_helpers import assets_available, make_tiny_model
from store_kinds import sqlite_only

from mortal.controller.manager import Controller
from mortal.state import open_store

pytestmark = [sqlite_only, pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")]
ray = pytest.importorskip("ray")
MAX_STEPS, EVERY = 4, 2


def test_a_killed_worker_node_leaves_the_final_weights_bit_equal(
    ray_cluster, store_url, mortal_home: Path, tmp_path: Path, monkeypatch
) -> None:
    hand_over(monkeypatch)
    model = make_tiny_model(tmp_path / "model")
    store = open_store(store_url)
    head = {"cpus": 0.5, "resources": {"node_head": 0.1}}
    on_workers = {"cpus": 0.5, "resources": {"rollout_node": 1}}
    for name, rollout in (("straight", head), ("node-kill", on_workers)):
        spec = actor_spec(
            str(model),
            algorithm={"maxSteps": MAX_STEPS, "maxStaleness": 0},
            checkpoint={"every": EVERY, "keep": 3},
            restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
            backend="ray",
            ray={"actor": head, "rollout": rollout},
            secrets=sorted(HANDED),
        )
        create_run(store, name, spec, SHORT_TASK_LEASE)
    controller = Controller(store, store_url, CONFIG).start()
    killed = None
    try:
        wait_for(
            lambda: store.latest_checkpoint("node-kill") is not None,
            600,
            "node-kill's first checkpoint",
            give_up=lambda: store.get_run("node-kill").phase == "Failed",
        )
        [rollout] = [
            w for w in store.list_workers("node-kill") if w.role == "rollout" and w.state == "Running"
        ]
        killed = ray_cluster.node_of_worker(mortal_home, f"node-kill/rollout-0#{rollout.incarnation}")
        assert killed in ("node_a", "node_b")
        ray_cluster.kill_node(killed)
        wait_for(lambda: store.get_run("node-kill").phase == "Recovering", 30, "node-kill Recovering")
        for name in ("straight", "node-kill"):
            wait_for(
                lambda name=name: store.get_run(name).phase in ("Succeeded", "Failed"), 600, f"{name} done"
            )
            assert store.get_run(name).phase == "Succeeded", store.get_run(name).status
        hashes = {name: final_weights_hash(store, name) for name in ("straight", "node-kill")}
        assert hashes["straight"] == hashes["node-kill"] and hashes["straight"][0] == MAX_STEPS, hashes
        finals = {name: final_checkpoint_hash(store, name, MAX_STEPS) for name in hashes}
        assert finals["straight"] == finals["node-kill"], finals
        assert [w.role for w in store.list_workers("node-kill")].count("rollout") >= 2, (
            "the rollout was not relaunched"
        )
    finally:
        leave_cluster_as_found(controller, store, ray_cluster, killed)


def test_an_actor_of_two_ranks_trains_in_one_ray_actor_and_checkpoints_both(
    ray_cluster, store_url, mortal_home: Path, tmp_path: Path, monkeypatch
) -> None:
    """actor {count: 2} on Ray: one Ray actor (its num_gpus the count on GPUs; CPU ranks over gloo here) whose
    worker starts its second rank itself; the run Succeeds and each checkpoint holds both ranks' shards."""
    from mortal.workers.actor.checkpoint import read_marker

    hand_over(monkeypatch)
    store = open_store(store_url)
    head = {"cpus": 0.5, "resources": {"node_head": 0.1}}
    spec = actor_spec(
        str(make_tiny_model(tmp_path / "model")),
        actor={"count": 2},
        algorithm={"maxSteps": 2, "batchSize": 8},
        checkpoint={"every": 1, "keep": 2},
        restartPolicy={"maxRestarts": 1, "backoffSeconds": 0.5},
        backend="ray",
        ray={"actor": head, "rollout": head},
        secrets=sorted(HANDED),
    )
    create_run(store, "ranks", spec, SHORT_TASK_LEASE)
    controller = Controller(store, store_url, CONFIG).start()
    try:
        wait_for(lambda: store.get_run("ranks").phase in ("Succeeded", "Failed"), 600, "ranks done")
        assert store.get_run("ranks").phase == "Succeeded", store.get_run("ranks").status
        assert [c.step for c in store.list_checkpoints("ranks")] == [1, 2]
        assert all(read_marker(c.path)["ranks"] == 2 for c in store.list_checkpoints("ranks"))
        assert [w.role for w in store.list_workers("ranks")].count("actor") == 1  # never relaunched
    finally:
        leave_cluster_as_found(controller, store, ray_cluster, None)
