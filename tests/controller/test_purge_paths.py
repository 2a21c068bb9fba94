"""`delete` moves (or with --purge removes) only the run's own folder: a run whose name or folder leads
outside MORTAL_HOME/runs (a name stored before the store checked names, a folder replaced by a symlink,
even one to another run's folder) is purged from the store with its files left alone and a Warning event
that outlives it; in checkpoint storage the same name is refused before anything is removed (on Modal's
volume: tests/controller/backends/test_modal.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from realproc import FAST
from store_kinds import sqlite_only

from mortal.controller.backends.base import remove_from_storage
from mortal.controller.backends.local import LocalBackend
from mortal.controller.leader import LeaderElector
from mortal.controller.outcome import Done
from mortal.controller.reconciler import Reconciler
from mortal.state import paths, sql_store
from mortal.state.containment import PathOutside
from mortal.workers.simulated import simulated_run


@pytest.fixture
def reconciler(store, store_url, mortal_home: Path) -> Reconciler:
    elector = LeaderElector(store, holder="me")
    assert elector.try_acquire()
    backend = LocalBackend(mortal_home)
    return Reconciler(store, store_url, elector, FAST, backends=lambda _: backend)


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Outside MORTAL_HOME: $MORTAL_HOME/runs/../../victim."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "precious.txt").write_text("not mortal's")
    return folder


def purge(store, reconciler: Reconciler, name: str, remove_files: bool = True) -> None:
    store.mark_deleted(name, purge=remove_files)
    for _ in range(5):
        if reconciler.reconcile(name) == Done() and not store.list_runs():
            return
    raise AssertionError(f"run {name!r} was not purged: {store.list_runs()}")


@sqlite_only  # the subject is the controller
def test_a_legacy_run_named_out_of_mortal_home_is_purged_without_touching_that_folder(
    store, reconciler, victim, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        sql_store, "check_run_name", lambda name: name, raising=False
    )  # a row from before the check
    name = "../../victim"
    paths.run_dir("another-run").mkdir(parents=True)  # runs/ exists, so runs/../.. reaches out
    assert paths.run_dir(name).resolve() == victim.resolve()
    store.apply_run(name, simulated_run("r").spec_dict())
    purge(store, reconciler, name)
    assert (victim / "precious.txt").read_text() == "not mortal's"
    [event] = [e for e in store.list_events(name) if e.type == "Warning"]
    assert event.reason == "PathOutside"
    assert event.message.startswith("deleted with its files left where they are, not removed: ")


@sqlite_only
@pytest.mark.parametrize("remove_files", [False, True], ids=["kept", "purged"])
def test_a_run_folder_replaced_by_a_symlink_out_of_mortal_home_is_not_followed(
    store, reconciler, victim, remove_files: bool
) -> None:
    """Deleted with or without --purge, the link is neither followed nor moved, and the Warning says the
    files were left where they are (as `mortalctl delete` said they would be)."""
    store.apply_run("r", simulated_run("r").spec_dict())
    paths.runs_dir().mkdir(parents=True)
    paths.run_dir("r").symlink_to(victim)
    purge(store, reconciler, "r", remove_files)
    assert (victim / "precious.txt").is_file() and not paths.kept_runs_dir().exists()
    [event] = [e for e in store.list_events("r") if e.type == "Warning"]
    assert event.reason == "PathOutside" and "left where they are" in event.message


@sqlite_only
@pytest.mark.parametrize("remove_files", [False, True], ids=["kept", "purged"])
def test_a_run_folder_that_links_to_another_runs_folder_is_neither_moved_nor_removed(
    store, reconciler, remove_files: bool
) -> None:
    """A link inside runs/ is no more the run's own than one out of MORTAL_HOME: the other run's files stay,
    and the Warning says the deleted run's files were left where they are."""
    store.apply_run("r", simulated_run("r").spec_dict())
    other = paths.checkpoints_dir("other")
    other.mkdir(parents=True)
    paths.run_dir("r").symlink_to(paths.run_dir("other"))
    purge(store, reconciler, "r", remove_files)
    assert other.is_dir() and not paths.kept_runs_dir().exists()
    [event] = [e for e in store.list_events("r") if e.type == "Warning"]
    kept = "not removed" if remove_files else "not moved aside"
    assert event.message.startswith(f"deleted with its files left where they are, {kept}: ")
    assert "as a folder of its own" in event.message


def test_a_name_that_leaves_the_runs_prefix_is_refused_in_storage(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    (bucket / "other").mkdir(parents=True)
    with pytest.raises(PathOutside):
        remove_from_storage("../bucket", f"file://{bucket}")
    with pytest.raises(PathOutside):
        remove_from_storage("..", f"file://{bucket}")
    assert (bucket / "other").is_dir()
