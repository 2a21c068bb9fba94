"""`mortalctl rollback`, `cp` and `fork` touch only the checkpoints the run owns: a checkpoint row that points
outside the run's checkpoints folder (a row written by hand, or through the HTTP store), or a symlink in that
folder that leads out, is refused with a Warning event on the run, never removed, moved or copied."""

from __future__ import annotations

from pathlib import Path

import pytest
from clihelpers import CHECKPOINT_FILES as FILES
from clihelpers import QUICKSTART, actor, checkpoint_in

from mortal.state import open_store, paths
from mortal.state.containment import REFUSED_REASON

pytestmark = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # the subject is the CLI


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A folder outside MORTAL_HOME that looks like a checkpoint: what a forged row points at."""
    return checkpoint_in(tmp_path / "victim", 20)


def stopped_with(store, rows: dict[int, str]) -> None:
    ref = actor(store, "quickstart")
    for step, path in rows.items():
        store.record_checkpoint(ref, step, path, step)
    store.heartbeat(ref, step=max(rows))
    for row in store.list_workers("quickstart", live_only=True):
        store.end_worker(row.id, "Stopped")


def refusals(store) -> list[str]:
    return [
        e.message
        for e in store.list_events("quickstart")
        if e.type == "Warning" and e.reason == REFUSED_REASON
    ]


@pytest.mark.parametrize("drop", [True, False])
def test_rollback_leaves_a_later_checkpoint_row_pointing_outside_alone(cli, store, victim, drop) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    own = checkpoint_in(paths.checkpoints_dir("quickstart") / "step-10", 10)
    stopped_with(store, {10: str(own), 20: str(victim)})
    result = cli("rollback", "quickstart", "--to", "step-10", *(["--drop-later"] if drop else []))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in victim.iterdir()) == sorted([*FILES, "mortal.json"]), (
        "never removed nor moved"
    )
    assert [c.step for c in store.list_checkpoints("quickstart")] == [10]
    [message] = refusals(store)
    assert message.startswith(f"rolling back checkpoint step-20: {victim} is not inside ")


def test_rollback_reads_a_relative_checkpoint_row_inside_the_run_not_the_working_folder(
    cli, store, victim, monkeypatch
) -> None:
    """The folder checked is the folder removed: "victim" means <run's checkpoints>/victim, not ./victim."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    own = checkpoint_in(paths.checkpoints_dir("quickstart") / "step-10", 10)
    monkeypatch.chdir(victim.parent)
    stopped_with(store, {10: str(own), 20: victim.name})
    assert cli("rollback", "quickstart", "--to", "step-10", "--drop-later").exit_code == 0
    assert sorted(p.name for p in victim.iterdir()) == sorted([*FILES, "mortal.json"]), "never removed"


def test_rollback_does_not_follow_a_symlink_in_the_runs_folder_that_leads_out(cli, store, victim) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    own = checkpoint_in(paths.checkpoints_dir("quickstart") / "step-10", 10)
    link = paths.checkpoints_dir("quickstart") / "step-20"
    link.symlink_to(victim)
    stopped_with(store, {10: str(own), 20: str(link)})
    assert cli("rollback", "quickstart", "--to", "step-10", "--drop-later").exit_code == 0
    assert (victim / "model.safetensors").is_file()
    [message] = refusals(store)
    assert f"(it resolves to {victim})" in message


def test_cp_refuses_a_checkpoint_row_pointing_outside(cli, store, victim, tmp_path) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    stopped_with(store, {20: str(victim)})
    result = cli("cp", "quickstart", str(tmp_path / "out"))
    assert (
        result.exit_code == 1
        and f"checkpoint step-20 of run 'quickstart': {victim} is not inside" in result.output
    )
    assert not (tmp_path / "out").exists()
    assert [m.split(":")[0] for m in refusals(store)] == ["copying checkpoint step-20"]


def test_cp_refuses_a_checkpoint_holding_a_symlink_that_leads_out(cli, store, tmp_path) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    secret = tmp_path / "secret.txt"
    secret.write_text("not the run's")
    own = checkpoint_in(paths.checkpoints_dir("quickstart") / "step-10", 10)
    (own / "tokenizer.json").symlink_to(secret)
    stopped_with(store, {10: str(own)})
    result = cli("cp", "quickstart", str(tmp_path / "out"))
    assert result.exit_code == 1 and "tokenizer.json is not inside" in result.output, result.output
    assert not (tmp_path / "out").exists() and len(refusals(store)) == 1


def test_cp_refuses_a_storage_url_that_leaves_the_runs_prefix(cli, store, spec_file, tmp_path) -> None:
    import fsspec

    assert cli("apply", "-f", str(spec_file(**{"spec.checkpoint.uri": "memory://owned"}))).exit_code == 0
    fsspec.filesystem("memory").pipe_file("/owned/other/step-10/mortal.json", b"{}")
    stopped_with(store, {10: "memory://owned/quickstart/../other/step-10"})
    result = cli("cp", "quickstart", str(tmp_path / "out"))
    assert result.exit_code == 1 and "is not inside memory://owned/quickstart" in result.output, result.output
    assert not (tmp_path / "out").exists() and len(refusals(store)) == 1


def test_fork_refuses_to_copy_a_parent_checkpoint_row_pointing_outside(cli, store, victim) -> None:
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    stopped_with(store, {20: str(victim)})
    result = cli("fork", "quickstart:step-20", "child")
    assert result.exit_code == 1 and "is not inside" in result.output, result.output
    assert [r.name for r in store.list_runs()] == ["quickstart"]
    assert not paths.run_dir("child").exists()
    assert refusals(store) and refusals(store)[0].startswith("reading checkpoint step-20")


def test_cp_refuses_a_modal_checkpoint_row_outside_the_runs_folder_on_its_volume(
    cli, store, tmp_path, monkeypatch
) -> None:
    from mortal.client import checkpoint_copy as cp

    monkeypatch.setattr(cp, "modal_data_volume", lambda: pytest.fail("the volume must not be read"))
    on_modal = tmp_path / "modal.yaml"
    on_modal.write_text(QUICKSTART.read_text() + "\n  backend: modal\n")
    assert cli("apply", "-f", str(on_modal)).exit_code == 0
    stopped_with(
        store, {10: f"{cp.MODAL_DATA_MOUNT}/runs/quickstart/checkpoints/../../other/checkpoints/step-10"}
    )
    result = cli("cp", "quickstart", str(tmp_path / "out"))
    assert result.exit_code == 1 and "is not inside /mortal/runs/quickstart/checkpoints" in result.output, (
        result.output
    )
    assert len(refusals(store)) == 1
