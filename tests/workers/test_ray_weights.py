"""mortal.workers.ray_weights without a cluster: what the hub keeps, and how a rollout's node receives a version
(whole, once per node, the oldest dropped, FileNotFoundError when the hub no longer has it). Ray itself is
replaced by a fake of the three calls `receive` makes; the real thing, across nodes: test_no_shared_fs_ray.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from mortal.state import paths
from mortal.workers import ray_weights
from mortal.workers.ray_weights import RECEIVED, SCHEME, WeightsHub


def test_the_hub_keeps_the_newest_versions_by_number() -> None:
    hub = WeightsHub(keep=3)
    for version in (8, 9, 10, 11):
        hub.put(f"v{version}-i2", [f"ref{version}"])
    assert hub.names() == ["v9-i2", "v10-i2", "v11-i2"]  # v10 sorts after v9: by number, not by text
    assert hub.get("v8-i2") is None and hub.get("v11-i2") == ["ref11"]


class FakeRay:
    """The hub of one namespace, holding {name: files} (a version's ObjectRef is its files here)."""

    exceptions = SimpleNamespace(RayActorError=type("RayActorError", (Exception,), {}),
                                 ObjectLostError=type("ObjectLostError", (Exception,), {}))

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


def test_a_version_is_written_whole_once_per_node_and_old_ones_dropped(fake: FakeRay, mortal_home: Path) -> None:
    folder = ray_weights.receive(publish(fake, 1), "run", "uid-1")
    assert folder == paths.weights_dir("run") / RECEIVED / "uid-1" / "v1-i1"
    assert (folder / "model.safetensors").read_bytes() == bytes([1]) * 64 and (folder / "config.json").is_file()
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
