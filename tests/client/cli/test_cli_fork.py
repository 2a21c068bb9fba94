"""`mortalctl fork` and `mortalctl rollback` on fake checkpoints (the training itself: tests/workers/
test_fork_rollback.py): what they refuse and how they say it, lineage in describe, and where later
checkpoints go."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from clihelpers import QUICKSTART, actor, checkpoint_in, set_status

from mortal.state import open_store, paths


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def checkpoint_folder(run: str, step: int) -> Path:
    return checkpoint_in(paths.checkpoints_dir(run) / f"step-{step}", step, run)


@pytest.fixture
def checkpointed(cli, store):
    """quickstart applied (maxSteps 30), complete checkpoints of steps 10 and 20, its actor stopped."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    ref = actor(store, "quickstart")
    for step in (10, 20):
        store.record_checkpoint(ref, step, str(checkpoint_folder("quickstart", step)), step)
    store.heartbeat(ref, step=20)
    for row in store.list_workers("quickstart", live_only=True):
        store.end_worker(row.id, "Stopped")
    return store


def fails(result, message: str) -> None:
    assert result.exit_code == 1, result.output
    assert message in result.output, result.output


def test_fork_links_the_checkpoint_records_lineage_and_applies_overrides(cli, checkpointed, tmp_path) -> None:
    store = checkpointed
    over = tmp_path / "over.yaml"
    over.write_text("spec:\n  algorithm:\n    beta: 0.1\nmetadata:\n  labels: {arm: b}\n")
    result = cli(
        "fork", "quickstart:step-10", "arm-b", "-f", str(over), "--set", "spec.algorithm.learningRate=1e-6"
    )
    assert result.exit_code == 0, result.output
    assert "trainingrun/arm-b created, forked from quickstart at step 10 (first step 11)" in result.output
    row = store.get_run("arm-b")
    assert (row.forked_from, row.forked_from_step) == ("quickstart", 10)
    assert row.spec["algorithm"]["learningRate"] == 1e-6 and row.spec["algorithm"]["beta"] == 0.1
    assert row.labels["arm"] == "b"
    [ckpt] = store.list_checkpoints("arm-b")
    copy, source = Path(ckpt.path), paths.checkpoints_dir("quickstart") / "step-10"
    assert (ckpt.step, ckpt.weight_version, copy) == (10, 10, paths.checkpoints_dir("arm-b") / "step-10")
    assert os.path.samefile(copy / "optimizer.pt", source / "optimizer.pt")  # hard-linked
    assert json.loads((copy / "mortal.json").read_text())["run"] == "arm-b"
    assert (
        json.loads((source / "mortal.json").read_text())["run"] == "quickstart"
    )  # the parent's is untouched
    described = cli("describe", "run", "arm-b").output
    assert "Forked from:" in described and "quickstart at step 10" in described
    assert "Forked from" not in cli("describe", "run", "quickstart").output
    assert "ForkCreated" in cli("describe", "run", "quickstart").output
    newest = cli("fork", "quickstart", "newest")
    assert newest.exit_code == 0 and store.get_run("newest").forked_from_step == 20


def test_a_fork_is_not_the_watched_folder_s_and_trains_though_its_parent_is_suspended(
    cli, checkpointed
) -> None:
    """The parent came from a watched folder and is suspended: the fork carries neither the folder's marks
    (the folder would delete it, its file being "gone") nor `suspend`, unless --set asks for it."""
    from mortal.controller.watchdir import SOURCE_ANNOTATION, SOURCE_LABEL

    store = checkpointed
    row = store.get_run("quickstart")
    labels = {**row.labels, SOURCE_LABEL: "abc123"}
    annotations = {**row.annotations, SOURCE_ANNOTATION: "/somewhere/watched"}
    store.apply_run("quickstart", {**row.spec, "suspend": True}, labels=labels, annotations=annotations)
    assert cli("fork", "quickstart", "child").exit_code == 0
    child = store.get_run("child")
    assert SOURCE_LABEL not in child.labels and SOURCE_ANNOTATION not in child.annotations
    assert child.labels["example"] == "quickstart", "the user's own labels are inherited"
    assert child.spec["suspend"] is False
    assert cli("fork", "quickstart", "held", "--set", "spec.suspend=true").exit_code == 0
    assert store.get_run("held").spec["suspend"] is True


def test_fork_refuses_with_the_run_and_step_named(cli, checkpointed) -> None:
    fails(cli("fork", "nope:step-10", "x"), "trainingrun 'nope' not found")
    fails(
        cli("fork", "quickstart:step-15", "x"),
        "trainingrun 'quickstart' has no complete checkpoint of step 15 (it keeps step-10, step-20)",
    )
    os.remove(paths.checkpoints_dir("quickstart") / "step-10" / "scheduler.pt")
    fails(cli("fork", "quickstart:step-10", "x"), "checkpoint step-10 of trainingrun 'quickstart' at ")
    fails(cli("fork", "quickstart:step-20", "quickstart"), "trainingrun 'quickstart' already exists")
    fails(
        cli("fork", "quickstart:step-20", "x", "--set", "spec.model.name=other"),
        "cannot fork quickstart:step-20 into 'x': the checkpoint cannot carry over\n  spec.model.name: ",
    )
    fails(
        cli("fork", "quickstart:step-20", "x", "--set", "spec.model.lora.r=4"),
        "spec.model.lora: the checkpoint holds full weights",
    )
    fails(
        cli("fork", "quickstart:step-20", "x", "--set", "spec.algorithm.learningRate=fast"),
        "error: --set: spec.algorithm.learningRate: must be a number (got 'fast')",
    )
    fails(cli("fork", "quickstart", "Bad_Name"), "NEW must be a DNS-1123 label")
    assert [r.name for r in checkpointed.list_runs()] == ["quickstart"]
    assert not paths.run_dir("x").exists()


@pytest.mark.parametrize("drop", [False, True])
def test_rollback_forgets_later_checkpoints_and_keeps_or_drops_their_files(
    cli, checkpointed, drop: bool
) -> None:
    store = checkpointed
    args = ["rollback", "quickstart", "--to", "step-10"] + (["--drop-later"] if drop else [])
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert "trainingrun/quickstart rolled back to step 10; later checkpoints: step-20" in result.output
    assert [c.step for c in store.list_checkpoints("quickstart")] == [10]
    assert not (paths.checkpoints_dir("quickstart") / "step-20").exists()
    kept = list((paths.run_dir("quickstart") / "rolled-back").glob("*/step-20"))
    assert (kept == []) if drop else (len(kept) == 1 and (kept[0] / "model.safetensors").is_file())
    assert [w.step for w in store.list_workers("quickstart")] == [10]
    assert store.get_run("quickstart").spec["suspend"] is False  # it was running: resumed
    [event] = [e for e in store.list_events("quickstart") if e.reason == "RolledBack"]
    assert event.message.startswith("rolled back to step 10 (later checkpoints step-20 ")


def test_a_rollback_whose_step_the_stopping_workers_prune_changes_nothing_and_resumes_the_run(
    checkpointed,
) -> None:
    """The actor's checkpoint as it stops may prune the step asked for (checkpoint.keep): nothing is rolled
    back, and the run this call suspended is resumed as it was, not left suspended."""
    from mortal.client.rollback import RollbackRefused, rollback_run

    store = checkpointed
    ref = actor(store, "quickstart")

    def stopping_prunes_step_10() -> None:
        store.delete_checkpoint(ref, 10)
        store.end_worker(next(w.id for w in store.list_workers("quickstart", live_only=True)), "Stopped")

    with pytest.raises(
        RollbackRefused, match="nothing was rolled back and trainingrun 'quickstart' was resumed"
    ):
        rollback_run(store, "quickstart", 10, on_suspend=stopping_prunes_step_10, stop_timeout=5)
    assert store.get_run("quickstart").spec["suspend"] is False
    assert [c.step for c in store.list_checkpoints("quickstart")] == [20]


def test_rollback_refuses_to_keep_later_checkpoints_through_a_link_out_of_the_run(
    cli, checkpointed, tmp_path
) -> None:
    """A `rolled-back` folder that is a link elsewhere (a worker writes the run's folder) is refused before
    anything changes: the run is neither suspended nor rolled back, and nothing is moved out."""
    store = checkpointed
    outside = tmp_path / "outside"
    outside.mkdir()
    (paths.run_dir("quickstart") / "rolled-back").symlink_to(outside)
    fails(cli("rollback", "quickstart", "--to", "step-10"), "cannot keep the later checkpoints")
    assert list(outside.iterdir()) == []
    assert [c.step for c in store.list_checkpoints("quickstart")] == [10, 20]
    assert not store.get_run("quickstart").spec.get("suspend")
    assert cli("rollback", "quickstart", "--to", "step-10", "--drop-later").exit_code == 0  # nothing kept


def test_rollback_refuses_finished_runs_missing_steps_and_runs_whose_workers_do_not_stop(
    cli, checkpointed
) -> None:
    store = checkpointed
    fails(cli("rollback", "quickstart", "--to", "step-15"), "no complete checkpoint of step 15")
    fails(cli("rollback", "nope", "--to", "step-1"), "trainingrun 'nope' not found")
    actor(store, "quickstart")  # a live worker that no controller stops
    fails(
        cli("rollback", "quickstart", "--to", "step-10", "--timeout", "0.5"),
        "workers still running after 0.5s (actor-0); it stays suspended, nothing was rolled back",
    )
    assert store.get_run("quickstart").spec["suspend"] is True
    assert [c.step for c in store.list_checkpoints("quickstart")] == [10, 20]
    store.end_worker(next(w.id for w in store.list_workers("quickstart", live_only=True)), "Stopped")
    result = cli("rollback", "quickstart", "--to", "step-10")
    assert result.exit_code == 0 and "still suspended" in result.output  # it was suspended: stays so
    set_status(store, "quickstart", phase="Succeeded")
    fails(
        cli("rollback", "quickstart", "--to", "step-10"),
        "is Succeeded; a finished run cannot be rolled back: "
        "fork it instead (mortalctl fork quickstart:step-10 NEW)",
    )


def test_fork_and_rollback_refuse_a_run_whose_checkpoints_are_on_modals_volume(
    cli, checkpointed, tmp_path
) -> None:
    on_modal = tmp_path / "modal.yaml"
    on_modal.write_text(
        QUICKSTART.read_text().replace("name: quickstart", "name: far") + "\n  backend: modal\n"
    )
    assert cli("apply", "-f", str(on_modal)).exit_code == 0
    refused = "trainingrun 'far' runs on backend 'modal', whose checkpoints are not on this machine"
    fails(cli("fork", "far", "x"), refused)
    fails(cli("rollback", "far", "--to", "step-10"), refused)
    assert not paths.run_dir("x").exists()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_fork_reads_a_checkpoint_in_mounted_storage_and_refuses_a_remote_one(cli, store, tmp_path) -> None:
    """spec.checkpoint.uri: a row holds the URL. file:// is a folder here; s3:// is not, and fork says how to
    get it."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    ref = actor(store, "quickstart")
    mounted = checkpoint_folder("quickstart", 10)
    store.record_checkpoint(ref, 10, f"file://{mounted}", 10)
    store.record_checkpoint(ref, 20, "s3://bucket/prefix/quickstart/step-20", 20)
    store.heartbeat(ref, step=20)
    for row in store.list_workers("quickstart", live_only=True):
        store.end_worker(row.id, "Stopped")
    forked = cli("fork", "quickstart:step-10", "child")
    assert forked.exit_code == 0, forked.output
    assert (paths.checkpoints_dir("child") / "step-10" / "optimizer.pt").read_bytes() == bytes([10]) * 100
    fails(
        cli("fork", "quickstart", "other"),
        "checkpoint step-20 of trainingrun 'quickstart' is in the storage of "
        "spec.checkpoint.uri (s3://bucket/prefix/quickstart/step-20); "
        "fork reads checkpoints on this machine only: "
        "download it with `mortalctl cp quickstart:step-20 DIR`",
    )


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_fork_of_a_ray_run_without_shared_disk_is_uploaded_where_its_nodes_look(
    cli, store, spec_file, tmp_path
) -> None:
    """ray.sharedFilesystem false: NEW's actor runs on a node that does not see this machine's MORTAL_HOME, so
    the forked checkpoint goes to NEW's spec.checkpoint.uri, and NEW's row records that URL."""
    bucket = tmp_path / "bucket"
    edits = {
        "spec.backend": "ray",
        "spec.ray": {"sharedFilesystem": False},
        "spec.checkpoint.uri": f"file://{bucket}",
    }
    assert cli("apply", "-f", str(spec_file(**edits))).exit_code == 0
    ref = actor(store, "quickstart")
    store.record_checkpoint(ref, 10, f"file://{checkpoint_folder('quickstart', 10)}", 10)
    store.heartbeat(ref, step=10)
    for row in store.list_workers("quickstart", live_only=True):
        store.end_worker(row.id, "Stopped")
    forked = cli("fork", "quickstart", "child")
    assert forked.exit_code == 0, forked.output
    [row] = store.list_checkpoints("child")
    assert row.path == f"file://{bucket}/child/step-10"
    assert (bucket / "child" / "step-10" / "optimizer.pt").read_bytes() == bytes([10]) * 100
    assert json.loads((bucket / "child" / "step-10" / "mortal.json").read_text())["run"] == "child"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_fork_carries_its_parent_s_code_snapshot(cli, store, tmp_path, monkeypatch) -> None:
    from mortal.controller.snapshot import CODE_ANNOTATION

    project = tmp_path / "project"
    project.mkdir()
    (project / "myrewards.py").write_text("def correct(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.chdir(project)
    builtin = "mortal.workers.rewards.builtin:correct_answer"
    spec = QUICKSTART.read_text().replace(builtin, "myrewards:correct")
    (project / "run.yaml").write_text(spec)
    assert cli("apply", "-f", "run.yaml").exit_code == 0
    ref = actor(store, "quickstart")
    store.record_checkpoint(ref, 10, str(checkpoint_folder("quickstart", 10)), 10)
    for row in store.list_workers("quickstart", live_only=True):
        store.end_worker(row.id, "Stopped")
    monkeypatch.chdir(tmp_path)  # forked from elsewhere: the code comes from the parent's snapshot
    result = cli("fork", "quickstart:step-10", "arm-b")
    assert result.exit_code == 0, result.output
    digest = store.get_run("arm-b").annotations[CODE_ANNOTATION]
    assert digest == store.get_run("quickstart").annotations[CODE_ANNOTATION]
    assert (paths.code_dir("arm-b", digest) / "myrewards.py").is_file()


def test_a_fork_is_admitted_in_its_parent_s_code_and_a_refused_one_leaves_nothing(
    cli, checkpointed, tmp_path
) -> None:
    """A fork's overrides are checked as `apply` checks a run, in the code the fork runs (its parent's):
    a reward the code lacks or a dataset file that is not there is refused naming the field, and no run,
    checkpoint copy or code folder is left under the new name."""
    result = cli("fork", "quickstart:step-20", "x", "--set", "spec.rewards[0].function=myrewards:missing")
    fails(result, "(the fork runs trainingrun 'quickstart''s code): spec.rewards[0].function: ")
    over = tmp_path / "over.yaml"
    over.write_text("spec:\n  dataset:\n    name: null\n    path: /nowhere/prompts.jsonl\n")
    fails(cli("fork", "quickstart:step-20", "x", "-f", str(over)), "spec.dataset.path: ")
    assert [r.name for r in checkpointed.list_runs()] == ["quickstart"]
    assert not paths.run_dir("x").exists()
    assert cli("fork", "quickstart:step-20", "x", "--set", "spec.algorithm.beta=0.1").exit_code == 0
