"""mortal.workers.sync.ray without a cluster: what the hub keeps, and how a rollout's node receives a version
(whole, once per node, the oldest dropped, FileNotFoundError when the hub no longer has it); and a hub lost
under a live publisher: the rollout backs off, the publisher puts its versions back, the rollout loads them.
Ray itself is replaced by fakes of the calls made; the real thing, across nodes: test_no_shared_fs_ray.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import create_run, new_worker, training_spec
from store_kinds import sqlite_only

from mortal.state import Store, paths
from mortal.state.containment import PathOutside
from mortal.workers.rollout import loop as rollout
from mortal.workers.runtime import WorkerContext
from mortal.workers.sync import ray as ray_weights
from mortal.workers.sync.publisher import WeightPublisher
from mortal.workers.sync.ray import RECEIVED, SCHEME, WeightsHub


def test_the_hub_keeps_the_newest_versions_by_number() -> None:
    hub = WeightsHub(keep=3)
    for version in (8, 9, 10, 11):
        hub.put(f"v{version}-i2", [f"ref{version}"])
    assert hub.names() == ["v9-i2", "v10-i2", "v11-i2"]  # v10 sorts after v9: by number, not by text
    assert hub.get("v8-i2") is None and hub.get("v11-i2") == ["ref11"]


class FakeRay:
    """The hub of one namespace, holding {name: files} (a version's ObjectRef is its files here)."""

    exceptions = SimpleNamespace(
        RayActorError=type("RayActorError", (Exception,), {}),
        ObjectLostError=type("ObjectLostError", (Exception,), {}),
    )

    def __init__(self) -> None:
        self.hub: WeightsHub | None = WeightsHub(keep=3)
        self.fetched: list[str] = []

    def get_actor(self, name: str, namespace: str):
        if self.hub is None or (namespace, name) != ("mortal-x-run", "weights-i1"):
            raise ValueError(f"Failed to look up actor {name!r}")
        return SimpleNamespace(get=SimpleNamespace(remote=lambda version: ("get", version)))

    def get(self, what):
        if isinstance(what, tuple):
            self.fetched.append(what[1])
            return self.hub.get(what[1])
        return what  # the "ObjectRef" is the files themselves


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeRay:
    ray = FakeRay()
    monkeypatch.setattr(ray_weights, "connect", lambda: ray)
    return ray


def publish(ray: FakeRay, version: int) -> str:
    files = {"model.safetensors": bytes([version]) * 64, "config.json": b"{}"}
    ray.hub.put(f"v{version}-i1", [files])
    return f"{SCHEME}mortal-x-run/weights-i1/v{version}-i1"


def test_a_version_is_written_whole_once_per_node_and_old_ones_dropped(
    fake: FakeRay, mortal_home: Path
) -> None:
    folder = ray_weights.receive(publish(fake, 1), "run", "uid-1")
    assert folder == paths.weights_dir("run") / RECEIVED / "uid-1" / "v1-i1"
    assert (folder / "model.safetensors").read_bytes() == bytes([1]) * 64 and (
        folder / "config.json"
    ).is_file()
    assert ray_weights.receive(f"{SCHEME}mortal-x-run/weights-i1/v1-i1", "run", "uid-1") == folder
    assert fake.fetched == ["v1-i1"], "a version this node holds was fetched again"
    for version in (2, 3, 4, 5):
        ray_weights.receive(publish(fake, version), "run", "uid-1")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["v3-i1", "v4-i1", "v5-i1"]
    # A run deleted and created again under the same name starts its versions over: never read its namesake's.
    again = ray_weights.receive(publish(fake, 5), "run", "uid-2")
    assert again == folder.parent.parent / "uid-2" / "v5-i1" and fake.fetched[-1] == "v5-i1"


def test_a_version_the_hub_no_longer_has_reads_as_removed(fake: FakeRay, mortal_home: Path) -> None:
    old = publish(fake, 1)
    for version in (2, 3, 4):
        publish(fake, version)
    with pytest.raises(FileNotFoundError, match="no longer held"):
        ray_weights.receive(old, "run", "uid")  # pruned by the hub (it keeps 3)
    newest = publish(fake, 5)
    fake.hub = None  # the actor that published it ended: its hub with it
    with pytest.raises(FileNotFoundError):
        ray_weights.receive(newest, "run", "uid")
    assert not any((paths.weights_dir("run") / RECEIVED / "uid").glob("*")), "a partial version was left"


def test_a_worker_not_started_by_the_ray_backend_is_told_so(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    monkeypatch.delenv(ray_weights.ADDRESS_ENV, raising=False)
    with pytest.raises(ray_weights.RayWeightsError, match="MORTAL_RAY_ADDRESS and MORTAL_RAY_NAMESPACE"):
        ray_weights.connect()


class RayActorError(Exception):
    pass


class FakeCluster:
    """Ray as sync ray's publisher and rollouts use it: put/get of objects, named actors
    made with get_if_exists, get_actor, and an actor that can be killed (its calls then
    raise RayActorError, its name is free)."""

    exceptions = SimpleNamespace(
        RayActorError=RayActorError,
        ObjectLostError=type("ObjectLostError", (Exception,), {}),
        GetTimeoutError=type("GetTimeoutError", (Exception,), {}),
    )
    util = SimpleNamespace(
        scheduling_strategies=SimpleNamespace(NodeAffinitySchedulingStrategy=lambda **kw: kw)
    )

    def __init__(self) -> None:
        self.actors: dict[str, FakeActor] = {}  # name -> live actor (one namespace)
        self.made = 0

    def put(self, value):
        return ("object", value)

    def remote(self, cls):
        cluster = self

        class Options:
            def options(self, name: str, get_if_exists: bool = False, **_):
                def make(*args):
                    if get_if_exists and name in cluster.actors:
                        return cluster.actors[name]
                    cluster.made += 1
                    cluster.actors[name] = FakeActor(cls(*args))
                    return cluster.actors[name]

                return SimpleNamespace(remote=make)

        return Options()

    def get_actor(self, name: str, namespace: str):
        if name not in self.actors:
            raise ValueError(f"Failed to look up actor {name!r}")
        return self.actors[name]

    def get(self, what, timeout=None):
        if isinstance(what, list):
            return [self.get(one) for one in what]
        if isinstance(what, FakeCall):
            if what.actor.dead:
                raise RayActorError("The actor died unexpectedly before finishing this task.")
            return getattr(what.actor.obj, what.method)(*what.args)
        return what[1]  # an object: its value

    def kill(self, name: str) -> None:
        self.actors.pop(name).dead = True


class FakeActor:
    def __init__(self, obj) -> None:
        self.obj, self.dead = obj, False

    def __getattr__(self, method: str):
        return SimpleNamespace(remote=lambda *args: FakeCall(self, method, args))


class FakeCall:
    def __init__(self, actor: FakeActor, method: str, args: tuple) -> None:
        self.actor, self.method, self.args = actor, method, args


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    ray = FakeCluster()
    monkeypatch.setattr(ray_weights, "connect", lambda: ray)
    monkeypatch.setattr(ray_weights, "_HUBS", {})
    monkeypatch.setattr(ray_weights, "_SHARED", {})
    monkeypatch.setenv(ray_weights.NAMESPACE_ENV, "mortal-x-run")
    return ray


def written(tmp_path: Path, version: int) -> Path:
    folder = tmp_path / f"v{version}-i1"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes([version]) * 64)
    return folder


def test_a_lost_hub_is_made_again_with_the_versions_its_publisher_keeps(
    cluster: FakeCluster, mortal_home: Path, tmp_path: Path
) -> None:
    paths_ = [ray_weights.share(written(tmp_path, v), 1) for v in range(5)]
    assert ray_weights.ensure_held(1) == [], "a hub that holds the newest version was made again"
    cluster.kill("weights-i1")  # the hub's actor ended while its publisher lives
    with pytest.raises(FileNotFoundError):
        ray_weights.receive(paths_[-1], "run", "uid")
    assert ray_weights.ensure_held(1) == ["v2-i1", "v3-i1", "v4-i1"]  # the newest KEEP, the same objects
    assert (ray_weights.receive(paths_[-1], "run", "uid") / "model.safetensors").read_bytes() == bytes(
        [4]
    ) * 64
    cluster.actors["weights-i1"].obj = WeightsHub(keep=3)  # alive, but holding nothing (restarted by hand)
    assert ray_weights.ensure_held(1) == ["v2-i1", "v3-i1", "v4-i1"]
    assert cluster.made == 2 and cluster.actors["weights-i1"].obj.names() == ["v2-i1", "v3-i1", "v4-i1"]


class RecordingEngine:
    def __init__(self) -> None:
        self.loads: list[str] = []

    def load_weights(self, path: str, transport: object = None) -> None:
        self.loads.append(Path(path).name)


@sqlite_only
def test_a_rollout_waits_with_backoff_until_the_actor_puts_a_lost_version_back(
    cluster: FakeCluster, store: Store, mortal_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rollout, "MISSING_RETRY_SECONDS", 30.0)  # no second try within the test
    run = create_run(store, "lost", training_spec("unused"))
    publisher = WeightPublisher(store, new_worker(store, run, "actor"), method="ray")
    ctx = WorkerContext(store, new_worker(store, run, "rollout"), run)
    worker = rollout.RolloutWorker(ctx, engine=RecordingEngine(), tokenizer=None, rewards=None)
    model = torch.nn.Linear(2, 2)
    publisher.publish(model, step=0)
    worker.refresh_weights()
    assert worker.loaded_version == 0
    publisher.publish(model, step=1)
    cluster.kill(ray_weights.hub_name(publisher.worker.incarnation))
    for _ in range(50):  # the rollout's loop asks at every turn: it must not hammer the hub
        worker.refresh_weights()
    assert worker.loaded_version == 0 and worker.engine.loads == ["v0-i1"], (
        "a version the hub lost was loaded"
    )
    assert worker._missing[:2] == (1, 1), "the rollout tried again before its backoff ended"
    publisher.ensure_held()  # the actor, waiting for rollouts of step 1 (its first look: no wait before it)
    publisher.ensure_held()  # ... the next look is HUB_CHECK_SECONDS later: nothing made again meanwhile
    assert cluster.made == 2
    monkeypatch.setattr(worker, "_missing", (1, 1, 0.0))  # the backoff has passed
    worker.refresh_weights()
    assert worker.loaded_version == 1 and worker.engine.loads == ["v0-i1", "v1-i1"]


def test_a_hub_path_that_leaves_the_nodes_received_folder_is_refused_before_ray_is_asked(mortal_home) -> None:
    for name in ("..", "."):
        with pytest.raises(PathOutside):
            ray_weights.receive(f"{SCHEME}mortal-x-c/weights-i1/{name}", "c", "uid-1")
    assert not paths.weights_dir("c").exists()
