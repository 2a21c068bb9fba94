"""The Modal volume hook of mortal.workers.atomic: nothing happens off Modal; on Modal every published
directory is committed once it is in place, and a reader missing a path reloads the volume first."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mortal.workers import atomic
from mortal.workers.atomic import VOLUME_ENV, atomic_dir


class RecordingVolume:
    """modal.Volume as the hook uses it: commit() and reload(), noting what the folder held at the time."""

    def __init__(self, watched: Path, reload_error: Exception | None = None) -> None:
        self.watched, self.reload_error = watched, reload_error
        self.commits: list[list[str]] = []
        self.reloads = 0

    def commit(self) -> None:
        self.commits.append(sorted(p.name for p in self.watched.iterdir()))

    def reload(self) -> None:
        self.reloads += 1
        if self.reload_error is not None:
            raise self.reload_error


@pytest.fixture
def volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RecordingVolume:
    vol = RecordingVolume(tmp_path)
    names = []
    monkeypatch.setitem(
        sys.modules,
        "modal",
        SimpleNamespace(Volume=SimpleNamespace(from_name=lambda name: names.append(name) or vol)),
    )
    monkeypatch.setenv(VOLUME_ENV, "mortal-data")
    vol.names = names
    return vol


def test_off_modal_nothing_is_committed_and_modal_is_never_imported(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(VOLUME_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "modal", None)  # an import would raise
    with atomic_dir(tmp_path / "v1") as tmp:
        (tmp / "w.json").write_text("{}")
    assert (tmp_path / "v1" / "w.json").exists()
    atomic.volume_refresh()


def test_each_published_directory_is_committed_once_in_place(tmp_path: Path, volume: RecordingVolume) -> None:
    with atomic_dir(tmp_path / "v1") as tmp:
        (tmp / "w.json").write_text("{}")
    assert volume.commits == [["v1"]] and volume.names == ["mortal-data"]
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "v2"):
        raise RuntimeError("crash mid-write")
    assert volume.commits == [["v1"]], "a write that failed publishes nothing, commits nothing"


def test_a_reader_missing_a_version_reloads_the_volume(
    tmp_path: Path, volume: RecordingVolume, caplog
) -> None:
    from mortal.workers.sync.volume import read_published

    with pytest.raises(FileNotFoundError):
        read_published(tmp_path / "v9")
    assert volume.reloads == 1
    volume.reload_error = RuntimeError("there are open files preventing the operation")
    with caplog.at_level(logging.WARNING, logger="mortal.worker"), pytest.raises(FileNotFoundError):
        read_published(tmp_path / "v9")
    assert "open files" in caplog.text
