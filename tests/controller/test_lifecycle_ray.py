"""`backend: ray` through the whole controller, on a real three-node Ray cluster (tests/raycluster.py),
with the simulated workload (real worker processes, fake training: seconds per run):

- a run Succeeds with its rollouts spread over both worker nodes and its actor on the head;
- a worker node is killed mid-run (its raylet and every process under it): the run goes Recovering and
  finishes on the nodes left;
- the controller is killed (SIGKILL) mid-run and another started: the same actors are adopted, no twin, no
  orphan;
- the node that runs the actor is killed: the actor is relaunched on another node and resumes from the
  newest checkpoint, no step's metrics lost;
- a run is rolled back while it trains and goes on from there; its last checkpoint is forked into a new run
  (tests/controller/test_lifecycle_rollback.py's story, on the cluster);
- rollouts are scaled 1 -> 3 -> 1 while training, then the run is suspended (nothing left in the cluster),
  resumed, and deleted with --purge;
- bad input: no cluster at spec.ray.address, and a request no node can ever hold, fail the run saying which
  field.

On SQLite only (the subject is the backend and the controller, tests/store_kinds.py), in a private network
namespace (scripts/test.sh runs this file in `unshare -rn`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from raycluster import RayCluster
from realproc import delete_and_wait, harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only
from test_lifecycle_rollback import roll_back_and_fork

from mortal.controller.logs import read_logs
from mortal.workers.simulated import simulated_run

ray = pytest.importorskip("ray")
pytestmark = sqlite_only
# The actor on the head, each rollout on a worker node (only they have rollout_node), half a CPU each.
PLACEMENT = {
    "actor": {"cpus": 0.5, "resources": {"node_head": 0.1}},
    "rollout": {"cpus": 0.5, "resources": {"rollout_node": 1}},
}


def ray_run(name: str, ray_spec: dict[str, Any] | None = None, **kw: Any):
    return simulated_run(name, spec={"backend": "ray", "ray": ray_spec or PLACEMENT}, **kw)


def nodes(h, cluster: RayCluster, role: str, run: str) -> list[str | None]:
    return sorted(cluster.node_of(p) or "?" for p in worker_processes(h.home, role=role, run=run))


def placed(h, cluster: RayCluster, run: str) -> dict[str, list[str | None]]:
    return {role: nodes(h, cluster, role, run) for role in ("actor", "rollout")}


def named_actors(run: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"].endswith(f"-{run}")
    )


def run_state(h, cluster: RayCluster, run: str) -> str:
    """What a failed wait prints: where the workers run, their rows, the run's events and Ray's named
    actors."""
    rows = [(w.role, w.replica, w.incarnation, w.state, w.message) for w in h.store.list_workers(run)]
    events = [(e.reason, e.message) for e in h.store.list_events(run, limit=30)]
    return f"placed: {placed(h, cluster, run)}\nrows: {rows}\nevents: {events}\nactors: {named_actors(run)}"


def live_ids(h, run: str) -> list[str]:
    """The process markers of the run's live rows (WorkerRef.process_id: the worker id and the run's uid)."""
    uid = h.store.get_run(run).uid
    return sorted(f"{w.run}/{w.role}-{w.replica}#{w.incarnation}@{uid}" for w in h.live_rows(run))


def test_a_run_succeeds_with_rollouts_on_both_worker_nodes(ray_cluster, harness):  # noqa: F811
    h, name = harness, "ray-e2e"
    h.apply(ray_run(name, max_steps=30, rollout_replicas=2, step_seconds=0.3))
    h.start()
    # Each worker's process appears once its Ray actor has started (seconds apart on a busy machine): the
    # run lasts long enough that both rollouts are up before it ends.
    wait_for(
        lambda: placed(h, ray_cluster, name) == {"actor": ["node_head"], "rollout": ["node_a", "node_b"]},
        60,
        "the actor on the head and one rollout on each worker node",
        details=lambda: run_state(h, ray_cluster, name),
    )
    assert named_actors(name) == live_ids(h, name)  # one actor per live worker row, named by its worker id
    final = h.wait_phase(name, "Succeeded", timeout=90)
    assert final["step"] == 30 and final["restarts"] == 0
    wait_for(
        lambda: not worker_processes(h.home, run=name) and not named_actors(name),
        30,
        "no worker process and no actor left in the cluster",
    )
    lines = list(read_logs(name, role="actor"))  # what `mortalctl logs` prints
    assert any("actor done at step 30" in line for line in lines), lines[-5:]


def test_rollouts_on_worker_nodes_import_the_reward_from_the_runs_code_snapshot(  # noqa: F811
    ray_cluster,
    harness,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    from mortal.controller.admission import admit_runs
    from mortal.controller.snapshot import CODE_ANNOTATION
    from mortal.state import paths

    h, name = harness, "ray-code"
    user = tmp_path / "user"
    user.mkdir()
    (user / "ray_rewards.py").write_text(
        "import os, pathlib\n"
        "if os.environ.get('MORTAL_ROLE') == 'rollout':\n"
        "    home = pathlib.Path(os.environ['MORTAL_HOME'])\n"
        "    (home / ('imported-' + os.environ['MORTAL_REPLICA'])).write_text(__file__)\n"
        "def correct(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    # Long enough that both rollouts start before it ends: a rollout imports the reward as it starts, and
    # on a busy machine one Ray actor may start seconds after the other.
    calls_rewards = {"mortal.dev/rewards": "call"}
    run = ray_run(name, max_steps=100_000, rollout_replicas=2, step_seconds=0.1, annotations=calls_rewards)
    run.spec.rewards[0].function = "ray_rewards:correct"
    with admit_runs([(run, "test")], [user]):  # what `mortalctl apply` does from the user's folder
        pass
    h.apply(run)
    h.start()  # started in the test's folder, where ray_rewards is not
    imported = [h.home / f"imported-{i}" for i in (0, 1)]
    wait_for(
        lambda: all(f.exists() for f in imported) and (h.status(name).get("step") or 0) >= 2,
        120,
        "both rollouts imported the reward, and the run trained with their scores",
        details=lambda: run_state(h, ray_cluster, name),
    )
    snapshot = paths.code_dir(name, run.metadata.annotations[CODE_ANNOTATION])
    assert [f.read_text() for f in imported] == [str(snapshot / "ray_rewards.py")] * 2
    status = h.status(name)
    assert (status["phase"], status.get("restarts", 0)) == ("Running", 0)  # no rollout failed to import it
    delete_and_wait(h, name)
    assert named_actors(name) == []


def test_a_killed_worker_node_is_recovered_from_on_the_nodes_left(ray_cluster, harness):  # noqa: F811
    h, name = harness, "ray-node-kill"
    # Steps enough that the run is still training when the relaunched rollout is seen (on a loaded machine
    # the loss is noticed and the relaunch started seconds after the kill; 60 steps were over by then).
    h.apply(ray_run(name, max_steps=150, rollout_replicas=2, step_seconds=0.1))
    h.start()
    wait_for(
        lambda: nodes(h, ray_cluster, "rollout", name) == ["node_a", "node_b"], 60, "a rollout on each node"
    )
    wait_for(lambda: (h.status(name).get("step") or 0) >= 4, 30, "training")
    try:
        ray_cluster.kill_node("node_a")
        h.wait_phase(name, "Recovering", timeout=20)
        wait_for(
            lambda: nodes(h, ray_cluster, "rollout", name) == ["node_b", "node_b"],
            60,
            "both rollouts on the node left",
            details=lambda: run_state(h, ray_cluster, name),
        )
        step = h.status(name)["step"]
        wait_for(lambda: h.status(name).get("step", 0) > step + 2, 30, "training again after the node loss")
        final = h.wait_phase(name, "Succeeded", timeout=120)
        assert final["step"] == 150 and final["restarts"] >= 1
        lost = [e.message for e in h.store.list_events(name, limit=200) if e.reason == "WorkerLost"]
        assert lost and all("rollout" in m for m in lost), lost
        wait_for(
            lambda: not worker_processes(h.home, run=name) and not named_actors(name), 30, "nothing left"
        )
    finally:
        ray_cluster.add_node("node_a")


def test_a_run_rolled_back_while_it_trains_goes_on_and_its_checkpoint_forks(ray_cluster, harness):  # noqa: F811
    roll_back_and_fork(harness, "ray-rollback", {"backend": "ray", "ray": PLACEMENT})
    wait_for(
        lambda: not named_actors("ray-rollback") and not named_actors("ray-rollback-more"),
        30,
        "no actor left",
    )


def test_a_killed_node_with_the_actor_resumes_from_the_newest_checkpoint(ray_cluster, harness):  # noqa: F811
    h, name = harness, "ray-actor-node-kill"
    # The actor on a worker node (where rollout_node is), the rollout on the head.
    placement = {
        "actor": {"cpus": 0.5, "resources": {"rollout_node": 1}},
        "rollout": {"cpus": 0.5, "resources": {"node_head": 0.1}},
    }
    h.apply(
        ray_run(name, placement, max_steps=120, rollout_replicas=1, step_seconds=0.1)
    )  # still training when seen
    h.start()
    wait_for(
        lambda: (h.status(name).get("step") or 0) >= 5 and h.store.latest_checkpoint(name),
        60,
        "training past a checkpoint",
    )
    [actor] = worker_processes(h.home, role="actor", run=name)
    node = ray_cluster.node_of(actor)
    assert node in ("node_a", "node_b")
    try:
        ray_cluster.kill_node(node)
        newest = h.store.latest_checkpoint(name).step  # nothing can write one any more
        h.wait_phase(name, "Recovering", timeout=20)
        other = ({"node_a", "node_b"} - {node}).pop()
        wait_for(
            lambda: nodes(h, ray_cluster, "actor", name) == [other], 60, f"the actor relaunched on {other}"
        )
        final = h.wait_phase(name, "Succeeded", timeout=120)
        assert final["step"] == 120 and final["restarts"] >= 1
        actors = [
            (w.incarnation, w.state, w.message) for w in h.store.list_workers(name) if w.role == "actor"
        ]
        assert h.resumed_from(name, actors[-1][0]) == newest, (
            "not resumed from the newest checkpoint",
            actors,
        )
        steps = {m.step for m in h.store.list_metrics(name, name="reward")}
        assert steps == set(range(1, 121)), "a step's metrics were lost"
    finally:
        ray_cluster.add_node(node)


def test_a_killed_controller_is_replaced_without_twins_or_orphans(ray_cluster, harness):  # noqa: F811
    h, name = harness, "ray-controller-kill"
    h.apply(ray_run(name, max_steps=60, rollout_replicas=2, step_seconds=0.1))
    first = h.spawn()
    wait_for(
        lambda: (h.status(name).get("step") or 0) >= 3 and len(worker_processes(h.home, run=name)) == 3,
        60,
        "training under the first controller, its three workers started",  # one Ray actor may start late
    )
    before = {p.pid for p in worker_processes(h.home, run=name)}
    rows_before = len(h.store.list_workers(name))
    actors_before = named_actors(name)
    assert len(before) == 3 and actors_before == live_ids(h, name)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

    h.start()
    step = h.status(name)["step"]
    wait_for(lambda: (h.status(name).get("step") or 0) > step + 3, 30, "training under the new controller")
    assert {p.pid for p in worker_processes(h.home, run=name)} == before, (
        "workers were relaunched, not adopted"
    )
    assert named_actors(name) == actors_before and len(h.store.list_workers(name)) == rows_before
    final = h.wait_phase(name, "Succeeded", timeout=90)
    assert final["restarts"] == 0
    wait_for(lambda: not worker_processes(h.home, run=name) and not named_actors(name), 30, "nothing left")


def test_scale_rollouts_1_3_1_while_training(ray_cluster, harness):  # noqa: F811
    h, name = harness, "ray-scale"

    def replicas(n: int):
        def change(spec):
            spec["rollout"] = {**spec["rollout"], "replicas": n}

        return change

    h.apply(ray_run(name, max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    h.start()
    h.wait_phase(name, "Running", timeout=60)
    actor_pid = worker_processes(h.home, role="actor", run=name)[0].pid
    for n in (3, 1):
        h.change_spec(name, replicas(n))
        wait_for(
            lambda n=n: len(worker_processes(h.home, role="rollout", run=name)) == n, 60, f"{n} rollouts"
        )
        wait_for(
            lambda n=n: h.status(name)["replicas"]["rollout"] == {"ready": n, "desired": n}, 30, f"{n} ready"
        )
        wait_for(lambda n=n: len(named_actors(name)) == n + 1, 30, f"{n + 1} actors in the cluster")
        step = h.status(name)["step"]
        wait_for(
            lambda step=step: h.status(name)["step"] > step + 2, 30, f"training to continue at {n} replicas"
        )
    assert [p.pid for p in worker_processes(h.home, role="actor", run=name)] == [actor_pid]
    assert h.status(name)["restarts"] == 0

    def suspend(value: bool):
        def change(spec):
            spec["suspend"] = value

        return change

    h.change_spec(name, suspend(True))
    h.wait_phase(name, "Suspended", timeout=30)
    wait_for(
        lambda: not worker_processes(h.home, run=name) and not named_actors(name), 30, "nothing left running"
    )
    step = h.status(name)["step"]
    h.change_spec(name, suspend(False))
    wait_for(lambda: h.status(name)["step"] > step + 2, 60, "training again after resume")
    assert len(named_actors(name)) == 2
    delete_and_wait(h, name, purge=True)
    assert named_actors(name) == [] and not (h.home / "runs" / name).exists()


def test_bad_input_fails_the_run_naming_the_field(ray_cluster, harness):  # noqa: F811
    h = harness
    h.apply(ray_run("ray-huge", {"rollout": {"cpus": 64}}))
    h.apply(ray_run("ray-nowhere", {"address": "127.0.0.1:1"}))
    # connected to the test cluster (RAY_ADDRESS): the run that names another address cannot run here
    h.start()
    huge = h.wait_phase("ray-huge", "Failed", timeout=60)
    assert "spec.ray.rollout" in str(huge["conditions"]) and "CPU=64" in str(huge["conditions"])
    nowhere = h.wait_phase("ray-nowhere", "Failed", timeout=60)
    assert "BackendUnavailable" in str(nowhere["conditions"]) and "spec.ray.address" in str(
        nowhere["conditions"]
    )
    assert not worker_processes(h.home) and not named_actors("ray-huge")

    # A controller of its own that reaches no cluster at all (nothing listens at the address).
    h.controllers.pop().stop()
    h.apply(ray_run("ray-nothing-there", {"address": "127.0.0.1:1"}))
    h.spawn(env={"RAY_ADDRESS": "127.0.0.1:1"})
    failed = h.wait_phase("ray-nothing-there", "Failed", timeout=60)
    assert "spec.ray.address: no Ray cluster answers at '127.0.0.1:1'" in str(failed["conditions"])
