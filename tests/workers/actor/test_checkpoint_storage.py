"""mortal.workers.actor.storage and the Checkpointer with spec.checkpoint.uri: the upload ends with the marker
and comes before the row, a half-finished upload is never resumed from, pruning forgets the row before the
files, and another machine (another MORTAL_HOME) downloads the newest checkpoint. On fsspec's memory and local
filesystems, on SQLite only (the subject is the storage); no cluster (across Ray nodes with no shared disk:
tests/workers/test_no_shared_fs_ray.py).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import fsspec
import pytest
from actor_helpers import create_run, worker_context
from store_kinds import sqlite_only
from test_checkpoint import SPEC, FakeTrainer, fake_save

from mortal.workers.actor import loop as actor
from mortal.workers.actor import trl_seam
from mortal.workers.actor.checkpoint import (
    MORTAL_FILE,
    Checkpointer,
    checkpoint_dir,
    is_complete,
    read_marker,
)
from mortal.workers.actor.storage import CheckpointStorage, StorageError, local_path
from mortal.workers.errors import FatalWorkerError


@pytest.fixture(params=["memory", "file"])
def uri(request, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://bucket-{uuid.uuid4().hex[:8]}/prefix"  # the memory filesystem is one per process
    return f"file://{tmp_path}/bucket/prefix"


@pytest.fixture
def made(store, uri: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(trl_seam, "save_checkpoint", fake_save)
    ctx = worker_context(store, create_run(store, "c", {**SPEC, "checkpoint": {"uri": uri}}), "actor")
    storage = CheckpointStorage(uri, "c")
    return Checkpointer(ctx.store, ctx.worker, every=2, keep=2, seed=5, storage=storage), storage


def remote_files(storage: CheckpointStorage) -> list[str]:
    return sorted(p[len(storage.root) + 1 :] for p in storage.fs.find(storage.root))


@sqlite_only
def test_the_marker_is_uploaded_last_and_the_row_recorded_after_it(made, store, monkeypatch) -> None:
    checkpointer, storage = made
    uploads = []
    put = storage.fs.put_file

    def watched(local: str, remote: str, *args, **kwargs):
        uploads.append((Path(remote).name, store.latest_checkpoint("c")))
        return put(local, remote, *args, **kwargs)

    monkeypatch.setattr(storage.fs, "put_file", watched)
    checkpointer.write(FakeTrainer(2), step=2, weight_version=3)
    assert uploads[-1][0] == MORTAL_FILE and len(uploads) == 6
    assert all(row is None for _, row in uploads), "a row was recorded before its files were all uploaded"
    row = store.latest_checkpoint("c")
    assert row.path == f"{storage.uri}/c/step-2" and storage.complete(row.path)
    assert is_complete(checkpoint_dir("c", 2))  # the local copy it was uploaded from stays


@sqlite_only
def test_a_half_finished_upload_is_invisible_and_replaced(made, store, monkeypatch) -> None:
    checkpointer, storage = made
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    put, count = storage.fs.put_file, []

    def dies_on_the_third_file(local: str, remote: str, *args, **kwargs):
        count.append(remote)
        if len(count) == 3:
            raise OSError("connection reset")
        return put(local, remote, *args, **kwargs)

    monkeypatch.setattr(storage.fs, "put_file", dies_on_the_third_file)
    with pytest.raises(StorageError, match="spec.checkpoint.uri: uploading step 4"):
        checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    assert [r.step for r in store.list_checkpoints("c")] == [2]
    assert "step-4/optimizer.pt" in remote_files(storage) and not storage.complete(f"{storage.uri}/c/step-4")
    assert checkpointer.resume_point().step == 2

    monkeypatch.setattr(storage.fs, "put_file", put)  # the relaunched actor writes step 4 again
    (checkpoint_dir("c", 4) / "model.safetensors").unlink()  # and had left something different locally
    checkpointer.write(FakeTrainer(4), step=4, weight_version=4)
    assert checkpointer.resume_point().step == 4
    assert [f for f in remote_files(storage) if f.startswith("step-4/")] == [
        f"step-4/{name}"
        for name in sorted(
            [
                "model.safetensors",
                "optimizer.pt",
                "scheduler.pt",
                "rng_state.pth",
                "trainer_state.json",
                MORTAL_FILE,
            ]
        )
    ]


@sqlite_only
def test_a_recorded_checkpoint_without_its_marker_is_forgotten(made, store) -> None:
    checkpointer, storage = made
    for step in (2, 4):
        checkpointer.write(FakeTrainer(step), step=step, weight_version=step)
    storage.fs.rm_file(f"{storage.root}/step-4/{MORTAL_FILE}")  # lost by the storage, or by hand
    assert is_complete(checkpoint_dir("c", 4))  # the local copy alone does not make it complete
    assert checkpointer.resume_point().step == 2
    assert [r.step for r in store.list_checkpoints("c")] == [2]


@sqlite_only
def test_pruning_forgets_the_row_before_deleting_the_files(made, store, monkeypatch) -> None:
    checkpointer, storage = made
    remove, seen = storage.remove, []

    def watched(url: str) -> None:
        seen.append((url, [r.path for r in store.list_checkpoints("c")]))
        remove(url)

    monkeypatch.setattr(storage, "remove", watched)
    for step in (2, 4, 6, 8):
        checkpointer.write(FakeTrainer(step), step=step, weight_version=step)
    assert [r.step for r in store.list_checkpoints("c")] == [6, 8]
    assert [url.rsplit("/", 1)[1] for url, _ in seen] == ["step-2", "step-4"]
    assert all(url not in rows for url, rows in seen), "files deleted while a row still pointed at them"
    assert sorted({f.split("/")[0] for f in remote_files(storage)}) == ["step-6", "step-8"]
    assert sorted(p.name for p in checkpoint_dir("c", 8).parent.iterdir()) == ["step-6", "step-8"]


@sqlite_only
def test_another_machine_downloads_the_newest_checkpoint(made, store, tmp_path: Path, monkeypatch) -> None:
    checkpointer, storage = made
    for step in (2, 4):
        checkpointer.write(FakeTrainer(step), step=step, weight_version=step + 1)
    written = {p.name: p.read_bytes() for p in checkpoint_dir("c", 4).iterdir()}
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path / "other-node"))  # a node that never saw those files
    assert not checkpoint_dir("c", 4).exists()
    resume = checkpointer.resume_point()
    assert (resume.step, resume.weight_version, resume.path) == (4, 5, str(checkpoint_dir("c", 4)))
    assert {p.name: p.read_bytes() for p in Path(resume.path).iterdir()} == written
    assert read_marker(resume.path)["step"] == 4
    assert store.latest_checkpoint("c").path == f"{storage.uri}/c/step-4"  # the store keeps the URL
    assert not checkpoint_dir("c", 2).exists()  # only the one resumed from is downloaded


@sqlite_only
def test_a_copy_found_on_this_machine_is_replaced_by_the_recorded_one(made, store) -> None:
    checkpointer, storage = made
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    uploaded = (checkpoint_dir("c", 2) / "optimizer.pt").read_bytes()
    (checkpoint_dir("c", 2) / "optimizer.pt").write_bytes(b"another incarnation's unrecorded write")
    relaunched = Checkpointer(store, checkpointer.worker, every=2, keep=2, seed=5, storage=storage)
    resume = relaunched.resume_point()
    assert resume.step == 2 and (Path(resume.path) / "optimizer.pt").read_bytes() == uploaded


@sqlite_only
def test_a_storage_that_cannot_be_read_is_an_error_not_a_lost_checkpoint(made, store, monkeypatch) -> None:
    checkpointer, storage = made
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)

    def unreachable(path: str) -> bool:
        raise OSError("name resolution failed")

    monkeypatch.setattr(storage.fs, "exists", unreachable)
    with pytest.raises(OSError):
        checkpointer.resume_point()
    assert [r.step for r in store.list_checkpoints("c")] == [2]


@sqlite_only
def test_a_url_that_cannot_be_used_fails_the_actor_naming_the_field(store, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for uri, fragment in (
        (f"file://{blocker}/prefix", "cannot write under"),
        ("nosuch://bucket/prefix", "Protocol not known"),
    ):
        run = create_run(store, f"bad-{len(fragment)}", SPEC)
        run.spec.checkpoint.__dict__["uri"] = (
            uri  # past the spec's check, as on a worker whose fsspec differs
        )
        with pytest.raises(FatalWorkerError) as caught:
            actor.checkpoint_storage(worker_context(store, run, "actor"))
        assert caught.value.reason == "CheckpointStorageUnavailable"
        assert (
            caught.value.message.startswith(f"spec.checkpoint.uri {uri!r}: ")
            and fragment in caught.value.message
        )


def test_a_storage_whose_package_is_missing_says_which(tmp_path: Path) -> None:
    try:
        fsspec.get_filesystem_class("s3")
        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    with pytest.raises(
        StorageError, match=r"spec.checkpoint.uri 's3://bucket/p': this machine lacks the package.*s3fs"
    ):
        CheckpointStorage("s3://bucket/p", "c")


def test_local_path_of_a_row() -> None:
    assert local_path("/home/x/runs/r/checkpoints/step-2") == Path("/home/x/runs/r/checkpoints/step-2")
    assert local_path("file:///mnt/bucket/p/r/step-2") == Path("/mnt/bucket/p/r/step-2")
    assert local_path("s3://bucket/p/r/step-2") is None


@sqlite_only
def test_checkpoints_recorded_under_another_uri_fail_the_actor_naming_the_field(
    made, store, monkeypatch
) -> None:
    checkpointer, _ = made
    checkpointer.write(FakeTrainer(2), step=2, weight_version=2)
    elsewhere = CheckpointStorage("memory://elsewhere/p", "c")
    with pytest.raises(StorageError, match="spec.checkpoint.uri 'memory://elsewhere/p'"):
        Checkpointer(store, checkpointer.worker, every=2, keep=2, seed=5, storage=elsewhere).resume_point()
    with pytest.raises(StorageError, match="this run's spec.checkpoint.uri is not set"):
        Checkpointer(store, checkpointer.worker, every=2, keep=2, seed=5).resume_point()
    assert [r.step for r in store.list_checkpoints("c")] == [2], "a checkpoint was forgotten"
