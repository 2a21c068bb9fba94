"""`controller --watch DIR`: the folder is the desired state (apply on change, delete when a file goes)."""

from __future__ import annotations

from pathlib import Path

from hostile_yaml import FAST_SECONDS, SMALL_BYTES, billion_laughs, bounded
from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.controller.watchdir import SOURCE_ANNOTATION, SOURCE_LABEL, source_id, sync_folder
from mortal.specs import to_yaml
from mortal.specs.parse_limits import MAX_NODES
from mortal.workers.simulated import simulated_run


def write(folder: Path, name: str, **kw) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(to_yaml(simulated_run(name, **kw), include_status=False))
    return path


def test_sync_applies_configures_and_deletes_only_its_own_runs(store, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    write(folder, "a")
    b = write(folder, "b")
    (folder / "notes.txt").write_text("not a spec")
    assert sync_folder(store, folder).applied == {"a": "created", "b": "created"}
    row = store.get_run("a")
    assert row.labels[SOURCE_LABEL] == source_id(folder)
    assert row.annotations[SOURCE_ANNOTATION] == str(folder.resolve())
    assert sync_folder(store, folder).applied == {"a": "unchanged", "b": "unchanged"}

    write(folder, "a", max_steps=9)
    assert sync_folder(store, folder).applied["a"] == "configured"

    hand = simulated_run("by-hand")
    store.apply_run("by-hand", hand.spec_dict(), annotations=hand.metadata.annotations)
    b.unlink()
    result = sync_folder(store, folder)
    assert result.deleted == ["b"]
    assert store.get_run("b").deleted_at is not None
    assert store.get_run("by-hand").deleted_at is None


def test_an_unreadable_file_deletes_nothing(store, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    write(folder, "a")
    b = write(folder, "b")
    sync_folder(store, folder)
    b.write_text("apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {name: b}\nspec: {model: {}}\n")
    (folder / "a.yaml").unlink()
    result = sync_folder(store, folder)
    assert result.errors and result.deleted == [] and result.kept == ["a", "b"]  # said, not done
    assert store.get_run("a").deleted_at is None
    (folder / "twice.yaml").write_text(write(folder, "c").read_text())
    errors = sync_folder(store, folder).errors
    assert f"run 'c' is defined more than once in {folder}: in c.yaml, twice.yaml" in errors


SHORT = """\
apiVersion: mortal/v1
kind: TrainingRun
metadata: {{name: {name}, annotations: {{mortal.dev/workload: simulated}}}}
spec:
  model: {{name: simulated}}
  algorithm: {{numGenerations: {n}, batchSize: {batch}, maxSteps: 5}}
"""


def test_a_run_the_merge_refuses_is_reported_and_the_folder_s_other_runs_go_on(store, tmp_path):
    """A scale (actor.count 2, which a's file leaves out) makes a's edited file not fit, batchSize 3 not
    dividing by it: a is reported by name and b's change is applied; c, whose file went, is deleted only
    once the folder has no refused run (it may be mid-edit)."""
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "a.yaml").write_text(SHORT.format(name="a", n=2, batch=4))
    for name in ("b", "c"):
        write(folder, name)
    sync_folder(store, folder)
    row = store.get_run("a")
    store.update_spec("a", {**row.spec, "actor": {**row.spec["actor"], "count": 2}}, row.resource_version)
    (folder / "a.yaml").write_text(SHORT.format(name="a", n=3, batch=3))
    write(folder, "b", max_steps=9)
    (folder / "c.yaml").unlink()
    result = sync_folder(store, folder)
    [error] = result.errors
    assert error.startswith(f"trainingrun/a in {folder}, with the fields kept from its live spec: ")
    assert "actor.count" in error
    assert result.applied == {"b": "configured"} and result.deleted == []
    (folder / "a.yaml").write_text(SHORT.format(name="a", n=2, batch=4))
    assert sync_folder(store, folder).deleted == ["c"]


@sqlite_only  # the subject is how the folder is read, not the store
def test_a_billion_laughs_file_is_refused_fast_and_deletes_nothing(store, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    write(folder, "a")
    sync_folder(store, folder)
    _, without_bomb, _ = bounded(lambda: sync_folder(store, folder))  # the folder's own cost (admitting "a")
    (folder / "lol.yaml").write_text(billion_laughs())
    result, seconds, peak = bounded(lambda: sync_folder(store, folder))
    assert seconds - without_bomb < FAST_SECONDS and peak < SMALL_BYTES, (seconds, without_bomb, peak)
    [error] = result.errors
    assert error.startswith(f"{folder / 'lol.yaml'}:") and "(MAX_ALIAS" in error
    assert result.applied == {"a": "unchanged"} and result.deleted == []


@sqlite_only  # the subject is how the folder is read, not the store
def test_a_file_of_more_values_than_the_limit_is_refused_naming_it_and_deletes_nothing(store, tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    write(folder, "a")
    sync_folder(store, folder)
    (folder / "wide.yaml").write_text("[" + ",".join(["{}"] * MAX_NODES) + "]\n")
    result = sync_folder(store, folder)
    [error] = result.errors
    assert error.startswith(f"{folder / 'wide.yaml'}:1: ") and error.endswith("(MAX_NODES)")
    assert result.applied == {"a": "unchanged"} and result.deleted == []


@sqlite_only  # the folder's sync is tested on every store above; this is the controller watching it
def test_controller_watch_runs_a_file_and_deletes_it_when_the_file_goes(harness, tmp_path):  # noqa: F811
    h = harness
    folder = tmp_path / "gitops"
    folder.mkdir()
    h.spawn("--watch", str(folder))
    spec = write(folder, "gitops", max_steps=100_000, rollout_replicas=1, step_seconds=0.1)
    wait_for(
        lambda: h.store.list_runs() and h.status("gitops").get("phase") == "Running", 30, "the run to start"
    )
    assert len(worker_processes(h.home, run="gitops")) == 2
    spec.unlink()
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be deleted and purged")
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


@sqlite_only
def test_a_watched_run_is_admitted_a_refused_one_is_not_applied_and_deletes_nothing(
    store, tmp_path, monkeypatch
):
    from mortal.controller.snapshot import CODE_ANNOTATION

    project, folder = tmp_path / "project", tmp_path / "project" / "runs"
    folder.mkdir(parents=True)
    (project / "myrewards.py").write_text("def correct(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(project)  # the controller's working folder is the applying one
    write(folder, "good", spec={"rewards": [{"function": "myrewards:correct"}]})
    kept = write(folder, "kept")
    assert sync_folder(store, folder).applied == {"good": "created", "kept": "created"}
    assert CODE_ANNOTATION in store.get_run("good").annotations
    write(folder, "bad", spec={"rewards": [{"function": "myrewards:absent"}]})
    kept.unlink()
    result = sync_folder(store, folder)
    assert "bad" not in result.applied and [e for e in result.errors if "spec.rewards[0].function" in e]
    assert [r.name for r in store.list_runs()] == ["good", "kept"] and result.deleted == []


@sqlite_only
def test_a_run_being_deleted_is_not_admitted_into_the_folder_its_purge_sets_aside(
    store, tmp_path, mortal_home, monkeypatch
):
    from mortal.state import paths

    project, folder = tmp_path / "project", tmp_path / "project" / "runs"
    folder.mkdir(parents=True)
    (project / "myrewards.py").write_text("def correct(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(project)  # its code is snapshotted into the run's folder
    write(folder, "going", spec={"rewards": [{"function": "myrewards:correct"}]})
    assert sync_folder(store, folder).applied == {"going": "created"}
    store.mark_deleted("going")
    run_folder = paths.run_dir("going")
    if run_folder.exists():  # as the purge would have moved it
        for child in sorted(run_folder.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
        run_folder.rmdir()
    result = sync_folder(store, folder)
    assert "going" not in result.applied and [e for e in result.errors if "being deleted" in e]
    assert not run_folder.exists()


def test_a_new_run_the_store_refuses_leaves_no_code_folder_under_its_name(
    store, tmp_path, mortal_home, monkeypatch
):
    """Admitted, its snapshot installed, then refused by the store (a value the database cannot hold, a
    creation race): the run was never created, so its name keeps no folder another run would find."""
    import mortal.controller.watchdir as watchdir
    from mortal.state import paths
    from mortal.state.errors import InvalidValue

    project, folder = tmp_path / "project", tmp_path / "project" / "runs"
    folder.mkdir(parents=True)
    (project / "myrewards.py").write_text("def correct(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(project)
    write(folder, "refused", spec={"rewards": [{"function": "myrewards:correct"}]})

    def refuse(*args, **kwargs):
        raise InvalidValue("the database refused a value")

    monkeypatch.setattr(watchdir, "apply_document", refuse)
    result = sync_folder(store, folder)
    assert result.applied == {} and result.errors == ["the database refused a value"]
    assert not paths.run_dir("refused").exists()


def _watching(store, folder: Path):
    """watch_folder in a thread, its syncs' results in a list; stopped by the returned callable."""
    import threading

    from mortal.controller.watchdir import watch_folder

    results: list = []
    stop = threading.Event()
    thread = threading.Thread(target=watch_folder, args=(store, folder, stop, results.append), daemon=True)
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join(15)

    return results, stopped


@sqlite_only
def test_a_run_re_added_while_its_deletion_is_in_flight_is_applied_once_the_purge_ends(
    store, tmp_path, monkeypatch
):
    """The file came back before the controller purged the deleted run: the sync says it applies the run
    once the deletion is done, and does so without waiting for another change in the folder."""
    import mortal.controller.watchdir as watchdir

    monkeypatch.setattr(watchdir, "RETRY_SECONDS", 0.5)
    folder = tmp_path / "runs"
    folder.mkdir()
    write(folder, "again")
    assert sync_folder(store, folder).applied == {"again": "created"}
    first = store.get_run("again").uid
    store.mark_deleted("again")
    results, stopped = _watching(store, folder)
    try:
        wait_for(lambda: results and results[0].retry, 15, "the first sync to meet the deletion")
        assert "trainingrun/again is being deleted: applied again once it is gone" in results[0].errors
        store.purge_run("again")
        wait_for(
            lambda: [r.uid for r in store.list_runs() if r.uid != first], 15, "the run to be created again"
        )
    finally:
        stopped()


@sqlite_only
def test_an_edit_of_the_file_a_link_in_the_folder_points_to_is_applied(store, tmp_path):
    folder, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    target = write(elsewhere, "linked", max_steps=400)
    (folder / "linked.yaml").symlink_to(target)
    results, stopped = _watching(store, folder)
    try:
        wait_for(lambda: results and results[0].applied == {"linked": "created"}, 15, "the first sync")
        write(elsewhere, "linked", max_steps=500)
        (elsewhere / "notes.yaml").write_text("not watched: no link points here")
        wait_for(
            lambda: store.get_run("linked").spec["algorithm"]["maxSteps"] == 500, 15, "the edit to apply"
        )
    finally:
        stopped()
