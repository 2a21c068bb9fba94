"""`mortalctl cp RUN[:step-N] DIR`: a complete checkpoint copied out whole (the newest unless a step
is named), from this machine or from the run's Modal volume; never a half-copied folder at DIR."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from clihelpers import QUICKSTART, actor

from mortal.client import checkpoint_copy as cp
from mortal.state import open_store, paths


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def checkpoint_folder(root: Path, step: int) -> Path:
    folder = root / f"step-{step}"
    (folder / "tokenizer").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes([step]) * 1000)
    (folder / "tokenizer" / "tokenizer.json").write_text(f'{{"step": {step}}}')
    return folder


@pytest.fixture
def checkpointed(cli, store, tmp_path):
    """quickstart applied, with complete checkpoints of steps 10 and 20 on this machine (in its folder)."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    ref = actor(store, "quickstart")
    for step in (10, 20):
        store.record_checkpoint(
            ref, step, str(checkpoint_folder(paths.checkpoints_dir("quickstart"), step)), step
        )
    return tmp_path


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cp_copies_the_newest_checkpoint_or_the_named_step(cli, checkpointed) -> None:
    newest = cli("cp", "quickstart", str(checkpointed / "out"))
    assert newest.exit_code == 0, newest.output
    assert newest.output.startswith("trainingrun/quickstart checkpoint step-20 (weights v20) copied to ")
    assert files(checkpointed / "out") == files(paths.checkpoints_dir("quickstart") / "step-20")
    named = cli("cp", "quickstart:step-10", str(checkpointed / "ten"))
    assert named.exit_code == 0 and files(checkpointed / "ten") == files(
        paths.checkpoints_dir("quickstart") / "step-10"
    )


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "quickstart:step-15",
            "run 'quickstart' has no complete checkpoint of step 15 (it keeps step-10, step-20)",
        ),
        ("quickstart:15", "'quickstart:15': expected RUN or RUN:step-N"),
        ("Bad_Name", "'Bad_Name': expected RUN or RUN:step-N"),
        ("absent", "absent"),
    ],
)
def test_cp_refuses_what_it_cannot_copy_and_says_why(cli, checkpointed, source, message) -> None:
    result = cli("cp", source, str(checkpointed / "out"))
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (checkpointed / "out").exists()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_cp_never_writes_into_a_folder_that_holds_files(cli, checkpointed) -> None:
    busy = checkpointed / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    result = cli("cp", "quickstart", str(busy))
    assert result.exit_code == 1 and "exists and is not an empty folder" in result.output
    assert files(busy) == {"mine.txt": b"keep me"}


def test_cp_to_stdout_is_a_usage_error_not_a_folder_named_dash(cli, checkpointed, monkeypatch) -> None:
    monkeypatch.chdir(checkpointed)
    result = cli("cp", "quickstart", "-")
    assert result.exit_code == 2 and "'-' (stdout) is not a folder" in result.output
    assert not (checkpointed / "-").exists()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_copy_that_fails_midway_leaves_nothing_at_the_destination(cli, checkpointed, monkeypatch) -> None:
    def copy_then_fail(source: Path, into: Path) -> None:
        (into / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(cp, "copy_local", copy_then_fail)
    result = cli("cp", "quickstart", str(checkpointed / "out"))
    assert result.exit_code == 1 and "disk full" in result.output
    assert sorted(p.name for p in checkpointed.iterdir()) == ["mortal_home"]  # no DIR, no staging folder


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_run_without_a_complete_checkpoint_is_refused(cli, tmp_path) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    result = cli("cp", "quickstart", str(tmp_path / "out"))
    assert result.exit_code == 1 and "run 'quickstart' has no complete checkpoint yet" in result.output


class FakeVolume:
    """The two modal.Volume calls cp makes, over a local folder standing in for the volume's root;
    each call is checked against the installed library's signature when modal is installed."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls = root, []

    def _check(self, name: str, *args, **kwargs) -> None:
        self.calls.append(name)
        try:
            import modal
        except ImportError:
            return
        inspect.signature(getattr(modal.Volume, name)).bind(self, *args, **kwargs)

    def listdir(self, path: str, recursive: bool = False):
        self._check("listdir", path, recursive=recursive)
        from modal.volume import FileEntryType

        found = (self.root / path).rglob("*") if recursive else (self.root / path).iterdir()
        return [
            SimpleNamespace(
                path=str(p.relative_to(self.root)),
                size=p.stat().st_size,
                type=FileEntryType.FILE if p.is_file() else FileEntryType.DIRECTORY,
            )
            for p in found
        ]

    def read_file(self, path: str):
        self._check("read_file", path)
        data = (self.root / path).read_bytes()
        yield from (data[i : i + 256] for i in range(0, len(data), 256))


def test_cp_reads_a_modal_runs_checkpoint_from_its_volume(tmp_path: Path) -> None:
    pytest.importorskip("modal")
    volume = FakeVolume(tmp_path / "volume")
    source = checkpoint_folder(tmp_path / "volume" / "runs" / "r" / "checkpoints", 30)
    into = tmp_path / "into"
    into.mkdir()
    copied = cp.copy_from_modal(f"{cp.MODAL_DATA_MOUNT}/runs/r/checkpoints/step-30", into, volume)
    assert files(into) == files(source) and copied == 1000 + len('{"step": 30}')
    assert volume.calls == ["listdir", "read_file", "read_file"]
    with pytest.raises(cp.ClientError, match="not on the Modal data volume"):
        cp.copy_from_modal("/elsewhere/step-30", into, volume)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_cp_as_a_user_runs_it(checkpointed, mortal_home, store_url) -> None:
    env = {
        **os.environ,
        "MORTAL_HOME": str(mortal_home),
        "MORTAL_STATE_URL": store_url,
        "MORTAL_NO_CONTROLLER": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mortal.client.cli.main",
            "cp",
            "quickstart:step-10",
            str(checkpointed / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert files(checkpointed / "out") == files(paths.checkpoints_dir("quickstart") / "step-10")
    again = subprocess.run(
        [sys.executable, "-m", "mortal.client.cli.main", "cp", "quickstart", str(checkpointed / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 1 and "exists and is not an empty folder" in again.stderr


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_cp_downloads_a_checkpoint_from_its_storage_url(cli, store, tmp_path, spec_file) -> None:
    """spec.checkpoint.uri: the row holds the URL (mortal.workers.actor.storage); cp downloads it with
    fsspec."""
    import fsspec

    assert cli("apply", "-f", str(spec_file(**{"spec.checkpoint.uri": "memory://cp-test"}))).exit_code == 0
    source = checkpoint_folder(tmp_path / "ckpts", 10)
    bucket = fsspec.filesystem("memory")
    for path in source.rglob("*"):
        if path.is_file():
            bucket.pipe_file(
                f"/cp-test/quickstart/step-10/{path.relative_to(source).as_posix()}", path.read_bytes()
            )
    store.record_checkpoint(actor(store, "quickstart"), 10, "memory://cp-test/quickstart/step-10", 10)
    copied = cli("cp", "quickstart", str(tmp_path / "out"))
    assert copied.exit_code == 0, copied.output
    assert files(tmp_path / "out") == files(source)
    store.record_checkpoint(
        actor(store, "quickstart"), 20, "memory://cp-test/quickstart/step-20", 20
    )  # not there
    gone = cli("cp", "quickstart", str(tmp_path / "out2"))
    assert (
        gone.exit_code == 1
        and "the checkpoint at memory://cp-test/quickstart/step-20 is empty or gone" in gone.output
    )
    assert not (tmp_path / "out2").exists()
