"""The Modal fake holds every call to the installed `modal` library's signatures (modal_fake.conform):
a misuse the real client would refuse fails the test even where the code under test swallows errors,
and the volume hook of mortal.workers.atomic commits and reloads through the checked Volume."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import modal
import pytest
from modal_fake import FakeModal, ModalAPIMisuse, conform

from mortal.controller.backends.modal import ModalBackend
from mortal.workers import atomic
from mortal.workers.atomic import VOLUME_ENV, atomic_dir

BODIES = {"worker": "modal_fake:exit_after"}


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeModal]:
    modal_fake = FakeModal(volume=tmp_path, functions=BODIES)
    yield modal_fake
    modal_fake.misuses.clear()  # the misuses below are on purpose
    modal_fake.shutdown()


@pytest.mark.parametrize(
    "api, args, kwargs",
    [
        (modal.Function.from_name, ("mortal", "worker"), {}),
        (modal.Function.with_options, (), {"gpu": "A100"}),
        (modal.Function.spawn, ({"run": "r"},), {}),
        (modal.FunctionCall.from_id, ("fc-1",), {}),
        (modal.FunctionCall.get, (), {"timeout": 0}),
        (modal.FunctionCall.cancel, (), {"terminate_containers": True}),
        (modal.Dict.from_name, ("mortal-workers",), {"create_if_missing": True}),
        (modal.Dict.put, ("k", {"v": 1}), {}),
        (modal.Dict.pop, ("k", None), {}),
        (modal.Volume.commit, (), {}),
        (modal.Volume.reload, (), {}),
        (modal.Volume.listdir, ("runs/r/logs",), {}),
        (modal.Volume.read_file, ("runs/r/logs/actor-0-1.log",), {}),
        (modal.Volume.remove_file, ("runs/r",), {"recursive": True}),
        (modal.Volume.batch_upload, (), {}),
        (modal.volume.VolumeUploadContextManager.put_file, ("/tmp/a.py", "runs/r/code/d/a.py"), {}),
    ],
)
def test_what_the_backend_calls_binds_to_the_installed_library(api, args, kwargs) -> None:
    bound = conform(api, *args, **kwargs)
    assert not {"self", "cls"} & set(bound), "bound as a caller binds, without self/cls"


@pytest.mark.parametrize(
    "misuse, match",
    [
        (lambda f: f.Function.from_name("mortal", "worker", "v2"), "from_name"),
        (lambda f: f.Function.from_name("mortal", "worker").with_options(gpus="A100"), "with_options"),
        (lambda f: f.FunctionCall.from_id("fc-1", "client", "extra"), "from_id"),
        (lambda f: f.FunctionCall.from_id("fc-1").get(0, 1), "get"),
        (lambda f: f.FunctionCall.from_id("fc-1").cancel(terminate=True), "cancel"),
        (lambda f: f.Dict.from_name("d", True), "from_name"),
        (lambda f: f.Dict.from_name("d", create_if_missing=True).put("k"), "put"),
        (lambda f: f.Volume.from_name("v").commit(wait=True), "commit"),
        (lambda f: f.Volume.from_name("v").listdir("runs", True), "listdir"),  # recursive is keyword-only
        (lambda f: f.Volume.from_name("v").remove_file("runs/r", recursive=True, force=True), "remove_file"),
    ],
)
def test_a_call_the_real_client_refuses_fails(fake: FakeModal, misuse, match) -> None:
    with pytest.raises(ModalAPIMisuse, match=match):
        misuse(fake)
    assert len(fake.misuses) == 1


def test_a_spawn_the_deployed_worker_cannot_take_fails_and_is_not_swallowed(fake: FakeModal) -> None:
    """The worker function is `worker(launch)`: two arguments fail at spawn, before any container starts."""
    function = fake.Function.from_name("mortal", "worker")
    with pytest.raises(ModalAPIMisuse, match="launch"):
        function.spawn({"env": {}}, "extra")
    assert fake.calls == {}
    with pytest.raises(ModalAPIMisuse, match="not serializable"):
        fake.Dict.from_name("d", create_if_missing=True).put("k", lambda: None)


def test_a_misuse_inside_the_backend_fails_the_test_at_shutdown(tmp_path: Path) -> None:
    """ModalBackend reads any Exception from FunctionCall.get as "the call ended"; a misuse is no Exception,
    and shutdown() reports it even if something swallowed it."""
    fake = FakeModal(volume=tmp_path, functions=BODIES)
    backend = ModalBackend(modal=fake)
    original = fake.FunctionCall.from_id
    fake.FunctionCall.from_id = lambda call_id: _WrongGet(original(call_id))
    fake.Dict.from_name("mortal-workers").put(
        "w", {"call_id": "fc-x", "run": "r", "role": "rollout", "replica": 0, "incarnation": 1}
    )
    with pytest.raises(ModalAPIMisuse, match="get"):
        backend.list()
    fake.misuses.append(ModalAPIMisuse("swallowed somewhere"))
    with pytest.raises(ModalAPIMisuse, match="call"):
        fake.shutdown()


class _WrongGet:
    """A FunctionCall used as an older client would: get(wait=...) (no such keyword in modal 1.x)."""

    def __init__(self, call) -> None:
        self._call = call

    def get(self, timeout: float | None = None):
        return self._call.get(wait=timeout)


def test_the_volume_hook_commits_and_reloads_through_the_checked_volume(
    fake: FakeModal, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "modal", fake)
    monkeypatch.setenv(VOLUME_ENV, "mortal-data")
    with atomic_dir(tmp_path / "weights" / "v1") as tmp:
        (tmp / "w.json").write_text("{}")
    atomic.volume_refresh()
    assert fake.commits == {"mortal-data": 1} and fake.reloads == {"mortal-data": 1}
    assert fake.misuses == []


def test_the_volume_as_a_client_sees_it_answers_as_modal_does(fake: FakeModal, tmp_path: Path) -> None:
    """listdir / read_file / remove_file over the folder the containers write; missing paths fail as in
    1.6."""
    (tmp_path / "runs" / "r" / "logs").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "logs" / "actor-0-1.log").write_bytes(b"x" * 5000)
    volume = fake.Volume.from_name("mortal-data")
    [entry] = volume.listdir("runs/r/logs")
    assert (entry.path, entry.size, entry.type) == (
        "runs/r/logs/actor-0-1.log",
        5000,
        modal.volume.FileEntryType.FILE,
    )
    assert b"".join(volume.read_file(entry.path)) == b"x" * 5000
    volume.remove_file("runs/r", recursive=True)
    with pytest.raises(fake.exception.NotFoundError):
        volume.listdir("runs/r/logs")
    with pytest.raises(FileNotFoundError):
        b"".join(volume.read_file(entry.path))
    with pytest.raises(FileNotFoundError):
        volume.remove_file("runs/r", recursive=True)
