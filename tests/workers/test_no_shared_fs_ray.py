"""Ray nodes that share no filesystem (ray.sharedFilesystem false): checkpoints through a storage URL, weights
through Ray's object store, and a node killed with the actor on it; the final weights are bit-equal.

A controller (in this process) runs two copies of one tiny real-model CPU run (maxStaleness 0) on the
three-node cluster of tests/raycluster.py, where each node has a MORTAL_HOME of its own: "straight" with
actor and rollout on the head, "node-kill" with its rollout on the head and its actor on a worker node, so
each weight version travels from one node to another through the object store (node-kill is applied once
straight's hub is killed, so that it cannot train to its end meanwhile). After node-kill's first
checkpoint (uploaded to a file:// URL, standing for a bucket), the node running its actor is SIGKILLed;
the actor is relaunched on the other worker node, downloads the checkpoint into that node's home and
resumes. "straight"'s weights hub is killed once its first version is recorded, before its rollout
fetched it (a hub lost under a live actor, for which a rollout once waited forever): its actor
puts the version back in a new hub. Both runs Succeed ("straight" never interrupted: its weights
hub lives on its own actor's node), their final checkpoints' tensors hash the same, the workers
wrote nothing under the controller's MORTAL_HOME, the relaunched actor's log is in the storage
(`mortalctl logs` reads it there), and no actor of either run (workers, weights hubs) is left in
the cluster. A second, short test drives mortal.workers.sync.ray alone between processes on the
cluster (a hub killed under its publisher included). Runs in `unshare -rn` (scripts/test.sh).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from actor_helpers import SHORT_TASK_LEASE, actor_spec, create_run, final_checkpoint_hash
from polling import wait_for
from ray_run_helpers import CONFIG, HANDED, hand_over, leave_cluster_as_found
from rollout_helpers import assets_available, make_tiny_model
from store_kinds import sqlite_only

from mortal.controller.backends import select_backend
from mortal.controller.logs import StorageLogs, read_logs
from mortal.controller.manager import Controller
from mortal.state import open_store
from mortal.workers.sync.ray import SCHEME

ray = pytest.importorskip("ray")
# Four steps: the first checkpoint the test sees can be step 2 when its polling thread is starved (few cores,
# the controller in this process), and the node must still be killed with steps left to train.
MAX_STEPS, EVERY = 4, 1
RUNS = ("straight", "node-kill")


@sqlite_only
@pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
def test_an_actor_node_lost_without_shared_disk_resumes_from_the_url_bit_equal(
    ray_cluster, store_url, mortal_home: Path, tmp_path: Path, monkeypatch
) -> None:
    hand_over(monkeypatch)
    model = make_tiny_model(tmp_path / "model")
    bucket = tmp_path / "bucket"
    store = open_store(store_url)
    head = {"cpus": 0.5, "resources": {"node_head": 0.1}}
    worker_node = {"cpus": 0.5, "resources": {"rollout_node": 1}}

    def create(name: str, actor: dict) -> None:
        spec = actor_spec(
            str(model),
            algorithm={"maxSteps": MAX_STEPS, "maxStaleness": 0},
            checkpoint={"every": EVERY, "keep": MAX_STEPS, "uri": f"file://{bucket}"},
            restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
            backend="ray",
            secrets=sorted(HANDED),
            ray={"sharedFilesystem": False, "actor": actor, "rollout": head},
        )
        create_run(store, name, spec, SHORT_TASK_LEASE)

    create("straight", head)
    controller = Controller(store, store_url, CONFIG).start()
    killed = None
    try:
        # "straight"'s hub is killed as soon as its first version is recorded, before its rollout (still
        # loading its model) fetched it: the rollout cannot have that version until the actor puts it back.
        wait_for(
            lambda: store.latest_weights("straight") is not None,
            600,
            "straight's first weight version",
            give_up=lambda: store.get_run("straight").phase == "Failed",
        )
        [hub] = [
            a
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"].endswith("-straight") and a["name"].startswith("weights-")
        ]
        ray.kill(ray.get_actor(hub["name"], namespace=hub["namespace"]))
        # How v0 then reached straight's rollout (the actor's put-back, or refs it held before the kill) is
        # not asserted: which one happened could not be told from the outside reliably (a check of the
        # received folder after the kill still saw no v0 while the put-back was not logged). The put-back
        # itself is tested on fake Ray (sync/test_ray.py); here the run must go on to the same weights.
        # node-kill is applied only now: while the test waited on straight, it once trained to its end
        # before its node could be killed.
        create("node-kill", worker_node)
        wait_for(
            lambda: store.latest_checkpoint("node-kill") is not None,
            600,
            "node-kill's first checkpoint",
            give_up=lambda: store.get_run("node-kill").phase == "Failed",
        )
        first = store.latest_checkpoint("node-kill")
        assert first.step < MAX_STEPS, (
            f"node-kill trained to its end before its node could be killed ({first.path})"
        )
        assert first.path == f"file://{bucket}/node-kill/step-{first.step}", first.path
        [actor] = [w for w in store.list_workers("node-kill") if w.role == "actor" and w.state == "Running"]
        killed = ray_cluster.node_of_worker(None, f"node-kill/actor-0#{actor.incarnation}")
        assert killed in ("node_a", "node_b")
        ray_cluster.kill_node(killed)
        wait_for(lambda: store.get_run("node-kill").phase == "Recovering", 30, "node-kill Recovering")
        resumed = store.latest_checkpoint(
            "node-kill"
        )  # what the relaunched actor downloads: none is written meanwhile
        for name in RUNS:
            wait_for(
                lambda name=name: store.get_run(name).phase in ("Succeeded", "Failed"), 600, f"{name} done"
            )
            assert store.get_run(name).phase == "Succeeded", store.get_run(name).status
        straight = [w.incarnation for w in store.list_workers("straight") if w.role == "actor"]
        assert len(straight) == 1, f"the reference run was interrupted too (actor incarnations {straight})"
        finals = {name: final_checkpoint_hash(store, name, MAX_STEPS) for name in RUNS}
        assert finals["straight"] == finals["node-kill"], finals

        other = ({"node_a", "node_b"} - {killed}).pop()
        actors = [w for w in store.list_workers("node-kill") if w.role == "actor"]
        assert len(actors) >= 2, "the actor was not relaunched"
        # The relaunched actor resumed on the other node from the copy it downloaded there
        # (its home had none).
        assert (
            ray_cluster.home(other) / "runs/node-kill/checkpoints" / f"step-{resumed.step}" / "mortal.json"
        ).is_file()
        assert all(row.path.startswith(SCHEME) for name in RUNS for row in store.list_weights(name))
        assert not (mortal_home / "runs").exists(), "a worker wrote under the controller's MORTAL_HOME"
        # `mortalctl logs` reads what each worker's Ray actor uploaded next to the checkpoints.
        logs = list(read_logs("node-kill", role="actor", source=StorageLogs(f"file://{bucket}")))
        assert any(
            f"actor-0#{actors[-1].incarnation}" in line and "exiting with code 0" in line for line in logs
        ), logs[-5:]
        wait_for(lambda: not _named_actors(), 30, "no actor (worker or weights hub) of either run left")
    finally:
        leave_cluster_as_found(controller, store, ray_cluster, killed)


PUBLISHER = """
import os, signal, sys, time
from pathlib import Path
stopped = []
# as mortal.workers.runtime's: stop at a step boundary
signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
from mortal.workers.sync import ray as ray_weights
folder = Path(sys.argv[1])
print(ray_weights.share(folder, 7), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("handler kept" if stopped else "handler lost", flush=True)
while sys.stdin.readline().strip() == "check":  # the actor's look at its hub while it waits for rollouts
    print(",".join(ray_weights.ensure_held(7)) or "-", flush=True)
"""


def test_a_published_version_reaches_another_process_and_ends_with_its_publisher(
    ray_cluster, mortal_home: Path, tmp_path: Path
) -> None:
    """ray_weights on the real cluster: the bytes arrive whole, joining Ray keeps the worker's SIGTERM handler
    (a suspended actor checkpoints), a hub killed under its live publisher is made again with the same version
    (and the controller's listing of the run's namespace, which holds the hub, is not upset by it), and the
    hub and its objects end with the process that published them."""
    from mortal.controller.backends.base import RAY_ADDRESS_ENV, RAY_NAMESPACE_ENV

    backend = select_backend("ray")
    namespace = backend.namespace("hub-run")
    folder = tmp_path / "v3-i7"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (folder / "config.json").write_text("{}")
    env = {**os.environ, RAY_ADDRESS_ENV: ray_cluster.address, RAY_NAMESPACE_ENV: namespace}
    publisher = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(folder)],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )

    def ask(line: str) -> str:
        publisher.stdin.write(line + "\n")
        publisher.stdin.flush()
        return publisher.stdout.readline().strip() if line else ""

    try:
        path = publisher.stdout.readline().strip()
        assert path == f"{SCHEME}{namespace}/weights-i7/v3-i7", path
        assert publisher.stdout.readline().strip() == "handler kept"
        received = Path(receive_elsewhere(env, path, tmp_path / "node-home").stdout.strip().splitlines()[-1])
        assert {p.name: p.read_bytes() for p in received.iterdir()} == {
            p.name: p.read_bytes() for p in folder.iterdir()
        }
        assert backend.list("hub-run") == [], "the hub was taken for a worker"
        assert ask("check") == "-", "a hub that holds the version was made again"
        ray.kill(ray.get_actor("weights-i7", namespace=namespace))  # lost under its live publisher
        lost = receive_elsewhere(env, path, tmp_path / "lost-home", check=False)
        assert lost.returncode != 0 and "FileNotFoundError" in lost.stderr
        assert ask("check") == "v3-i7"
        again = Path(receive_elsewhere(env, path, tmp_path / "later-home").stdout.strip().splitlines()[-1])
        assert {p.name: p.read_bytes() for p in again.iterdir()} == {
            p.name: p.read_bytes() for p in folder.iterdir()
        }
        ask("")
        assert publisher.wait(timeout=60) == 0
        wait_for(
            lambda: (
                not [
                    a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace
                ]
            ),
            30,
            "the hub ended with its publisher",
        )
        gone = receive_elsewhere(env, path, tmp_path / "other-home", check=False)
        assert gone.returncode != 0 and "FileNotFoundError" in gone.stderr and "no longer held" in gone.stderr
    finally:
        publisher.kill()


def receive_elsewhere(
    env: dict[str, str], path: str, home: Path, check: bool = True
) -> subprocess.CompletedProcess:
    """`receive` in a process of its own (another worker, on another MORTAL_HOME): it
    prints the folder it wrote."""
    script = (
        "import sys; from mortal.workers.sync import ray as ray_weights; "
        "print(ray_weights.receive(sys.argv[1], 'run', 'uid'))"
    )
    return subprocess.run(
        [sys.executable, "-c", script, path],
        env={**env, "MORTAL_HOME": str(home)},
        text=True,
        capture_output=True,
        timeout=120,
        check=check,
    )


def _named_actors() -> list[str]:
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"].endswith(tuple(f"-{run}" for run in RUNS))
    ]
