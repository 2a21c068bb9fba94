"""The Ray backend on a real three-node Ray cluster (tests/raycluster.py): launch, list, adopt,
exit codes, stop, a lost node, requests no node can hold, and the errors of a missing package or cluster.

Runs in a private network namespace (scripts/test.sh: `unshare -rn`); the `ray_cluster` fixture says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from polling import wait_for
from raycluster import RayCluster

from mortal.controller.backends import BackendUnavailable, Unschedulable, WorkerLaunch, select_backend
from mortal.state import WorkerRef, paths

ray = pytest.importorskip("ray")
from mortal.controller.backends.ray import RayBackend  # noqa: E402 - after the skip: it needs ray to be made

SLEEPER = [sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(600)"]
EXIT_7 = [sys.executable, "-c", "import sys; sys.exit(7)"]


def launch_of(
    home: Path, run: str, role: str = "rollout", replica: int = 0, incarnation: int = 1, **kw: object
) -> WorkerLaunch:
    ref = WorkerRef(run, role, replica, incarnation)
    return WorkerLaunch(
        run=run,
        role=role,
        replica=replica,
        incarnation=incarnation,
        worker_id=ref.id,
        state_url="sqlite:///unused.db",
        mortal_home=str(home),
        **kw,
    )  # type: ignore[arg-type]


def processes_of(home: Path) -> dict[str, psutil.Process]:
    """Live worker processes of this home by worker id (the Ray nodes are processes of this machine)."""
    found = {}
    for proc in psutil.process_iter(["environ", "status"]):
        env = proc.info.get("environ") or {}
        if (
            env.get("MORTAL_HOME") == str(home)
            and "MORTAL_WORKER_ID" in env
            and proc.info.get("status") != psutil.STATUS_ZOMBIE
        ):
            found[env["MORTAL_WORKER_ID"]] = proc
    return found


def test_launch_spreads_rollouts_lists_adopts_and_stops(ray_cluster: RayCluster, mortal_home: Path) -> None:
    backend = RayBackend(home=mortal_home, command=SLEEPER)
    on_workers = {"resources": {"node_a": 0.1}}, {"resources": {"node_b": 0.1}}
    handles = [
        backend.launch(launch_of(mortal_home, "spread", replica=i, cpus=0.5, **on_workers[i])) for i in (0, 1)
    ]
    actor = backend.launch(
        launch_of(mortal_home, "spread", role="actor", cpus=0.5, resources={"node_head": 0.1})
    )
    procs = wait_for(lambda: len(p := processes_of(mortal_home)) == 3 and p, 60, "three worker processes")
    assert {ray_cluster.node_of(p) for p in procs.values()} == {"node_head", "node_a", "node_b"}
    rollout = procs["spread/rollout-0#1"]
    assert rollout.environ()["MORTAL_RUN"] == "spread" and rollout.environ()["CUDA_VISIBLE_DEVICES"] == ""
    log = paths.worker_log("spread", "rollout", 0, 1)
    wait_for(
        lambda: log.exists() and "sleeping" in log.read_text(), 30, "the worker's output in its log file"
    )

    listed = backend.list("spread")
    assert [(w.role, w.replica, w.alive) for w in listed] == [
        ("actor", 0, True),
        ("rollout", 0, True),
        ("rollout", 1, True),
    ]
    assert {w.handle for w in listed} == {*handles, actor}
    assert backend.list("another-run") == []

    # A restarted controller (a backend with no memory) lists the same actors and launches no twin.
    fresh = RayBackend(home=mortal_home, command=SLEEPER)
    assert [w.handle for w in fresh.list("spread")] == [w.handle for w in listed]
    assert fresh.launch(launch_of(mortal_home, "spread", replica=0, cpus=0.5)) == handles[0]
    assert processes_of(mortal_home).keys() == procs.keys()
    # Another MORTAL_HOME on the same cluster sees none of them.
    assert RayBackend(home=mortal_home / "other", command=SLEEPER).list() == []

    fresh.stop(handles[0], grace_seconds=2)
    assert "spread/rollout-0#1" not in processes_of(mortal_home)
    assert [w.worker_id for w in fresh.list("spread")] == ["spread/actor-0#1", "spread/rollout-1#1"]
    fresh.stop(handles[0])  # stopping an unknown or stopped handle is a no-op
    for handle in (handles[1], actor):
        fresh.stop(handle, grace_seconds=2)
    assert processes_of(mortal_home) == {} and fresh.list("spread") == []
    assert not [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == fresh.namespace("spread")
    ], "an actor was left in the cluster"


def test_an_exit_code_is_listed_and_the_actor_freed(ray_cluster: RayCluster, mortal_home: Path) -> None:
    backend = RayBackend(home=mortal_home, command=EXIT_7)
    handle = backend.launch(launch_of(mortal_home, "exits", cpus=0.5))
    [ended] = wait_for(lambda: [w for w in backend.list("exits") if not w.alive], 60, "the worker's exit")
    assert (ended.handle, ended.exit_code) == (handle, 7)
    namespace = backend.namespace("exits")
    wait_for(
        lambda: (
            not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
        ),
        10,
        "the ended worker's actor to be killed (its resources freed)",
    )
    assert [(w.alive, w.exit_code) for w in backend.list("exits")] == [
        (False, 7)
    ]  # remembered, for the planner
    backend.stop(handle)
    assert backend.list("exits") == []


STUCK = [
    sys.executable,
    "-c",
    "import time\n"
    "from mortal.workers.deadline import register_stack_dump\n"
    "register_stack_dump()\n"
    "def stuck_in_a_task():\n"
    "    print('stuck', flush=True)\n"
    "    time.sleep(600)\n"
    "stuck_in_a_task()\n",
]


def test_a_workers_stacks_are_asked_for_through_its_actor(ray_cluster: RayCluster, mortal_home: Path) -> None:
    """The controller cannot signal a process on another node; the worker's actor can (SIGUSR1, which the
    worker answers as it does locally: every thread's stack in its log)."""
    backend = RayBackend(home=mortal_home, command=STUCK)
    handle = backend.launch(launch_of(mortal_home, "stacks", cpus=0.5, resources={"node_a": 0.1}))
    log = paths.worker_log("stacks", "rollout", 0, 1)
    wait_for(lambda: log.exists() and "stuck" in log.read_text(), 60, "the worker stuck in its task")
    assert backend.dump_stacks(handle)
    wait_for(lambda: "in stuck_in_a_task" in log.read_text(), 10, "the stuck frame in the worker's log")
    assert processes_of(mortal_home), "asked for its stacks, the worker runs on"
    backend.stop(handle, grace_seconds=0)
    assert not backend.dump_stacks(handle), "no actor: nothing to signal"
    assert not backend.dump_stacks("pid:42"), "not a Ray handle"


def test_an_actor_waiting_for_resources_is_alive_and_stops_at_once(
    ray_cluster: RayCluster, mortal_home: Path
) -> None:
    backend = RayBackend(home=mortal_home, command=SLEEPER)
    first = backend.launch(launch_of(mortal_home, "busy", replica=0, cpus=0, resources={"node_a": 1}))
    waiting = backend.launch(launch_of(mortal_home, "busy", replica=1, cpus=0, resources={"node_a": 1}))
    wait_for(lambda: "busy/rollout-0#1" in processes_of(mortal_home), 60, "the first worker's process")
    started = time.monotonic()
    assert [(w.handle, w.alive) for w in backend.list("busy")] == [(first, True), (waiting, True)]
    assert time.monotonic() - started < 2, "a pending actor held up the listing"
    assert list(processes_of(mortal_home)) == ["busy/rollout-0#1"]
    started = time.monotonic()
    backend.stop(waiting, grace_seconds=5)
    assert time.monotonic() - started < 5, "stopping an actor that never started waited for it"
    backend.stop(first, grace_seconds=5)
    assert backend.list("busy") == [] and processes_of(mortal_home) == {}


def test_a_lost_node_lists_its_worker_as_exited(ray_cluster: RayCluster, mortal_home: Path) -> None:
    backend = RayBackend(home=mortal_home, command=SLEEPER)
    handle = backend.launch(launch_of(mortal_home, "lost", cpus=0.5, resources={"node_b": 0.1}))
    proc = wait_for(lambda: processes_of(mortal_home).get("lost/rollout-0#1"), 60, "the worker process")
    wait_for(lambda: [w.alive for w in backend.list("lost")] == [True], 10, "the worker listed alive")
    try:
        ray_cluster.kill_node("node_b")
        [gone] = wait_for(lambda: [w for w in backend.list("lost") if not w.alive], 30, "the lost worker")
        assert (gone.handle, gone.exit_code) == (handle, None)
        assert not proc.is_running()
        backend.stop(handle, grace_seconds=0)
    finally:
        ray_cluster.add_node("node_b")


def test_a_request_no_node_can_hold_is_unschedulable_naming_the_field(
    ray_cluster: RayCluster, mortal_home: Path
) -> None:
    backend = RayBackend(home=mortal_home, command=SLEEPER)
    with pytest.raises(Unschedulable, match=r"CPU=64.*change spec\.ray\.rollout"):
        backend.launch(launch_of(mortal_home, "huge", cpus=64))
    with pytest.raises(Unschedulable, match=r"change spec\.actor\.gpu"):
        backend.launch(launch_of(mortal_home, "huge", role="actor", gpu="H100"))
    with pytest.raises(Unschedulable, match=r"nvme_node"):
        backend.launch(launch_of(mortal_home, "huge", resources={"nvme_node": 1}))
    assert backend.list("huge") == [] and processes_of(mortal_home) == {}


def test_no_cluster_at_the_address_names_the_field(ray_cluster: RayCluster, tmp_path: Path) -> None:
    code = "from mortal.controller.backends import select_backend\nselect_backend('ray@127.0.0.1:1')\n"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "BackendUnavailable: spec.ray.address: no Ray cluster answers at '127.0.0.1:1'" in done.stderr


def test_without_ray_installed_or_an_address_the_error_says_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    with pytest.raises(BackendUnavailable, match=r"pip install 'mortal\[ray\]'"):
        select_backend("ray")
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(BackendUnavailable, match=r"set spec\.ray\.address"):
        select_backend("ray")


def test_a_run_s_code_snapshot_travels_to_a_node_that_shares_no_disk(
    ray_cluster: RayCluster, mortal_home: Path, tmp_path: Path
) -> None:
    from mortal.controller.snapshot import build
    from mortal.workers.simulated import simulated_run

    user = tmp_path / "user"
    user.mkdir()
    (user / "myrewards.py").write_text("def correct(completions, **kwargs):\n    return [1.0]\n")
    run = simulated_run("shipped", spec={"rewards": [{"function": "myrewards:correct"}]})
    snapshot = build(run.spec, [user])
    snapshot.install("shipped")
    snapshot.close()
    imports = [
        sys.executable,
        "-c",
        "import os, time; from mortal.state import WorkerRef; "
        "from mortal.workers.main import use_code_snapshot; "
        "use_code_snapshot(os.environ, WorkerRef(os.environ['MORTAL_RUN'], 'rollout', 0, 1)); "
        "import myrewards; print('imported', myrewards.__file__, flush=True); time.sleep(600)",
    ]
    backend = RayBackend(home=mortal_home, command=imports)
    handle = backend.launch(
        launch_of(
            mortal_home,
            "shipped",
            cpus=0.5,
            resources={"node_a": 0.1},
            node_home=True,
            env={paths.CODE_SNAPSHOT_ENV: snapshot.digest},
        )
    )
    node_copy = paths.code_dir("shipped", snapshot.digest, ray_cluster.home("node_a"))
    rel = paths.worker_log("shipped", "rollout", 0, 1).relative_to(paths.mortal_home())
    log = ray_cluster.home("node_a") / rel
    wait_for(lambda: log.exists() and "imported" in log.read_text(), 60, "the worker importing its reward")
    assert (node_copy / "myrewards.py").is_file()
    assert f"imported {node_copy / 'myrewards.py'}" in log.read_text()  # the worker runs in its node's copy
    backend.stop(handle, grace_seconds=2)
