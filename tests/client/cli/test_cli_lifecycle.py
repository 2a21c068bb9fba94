"""`mortalctl delete | suspend | resume run NAME` and `delete -f FILE`."""

from __future__ import annotations

import shutil
import threading

import pytest
from clihelpers import QUICKSTART, set_status

from mortal.client import apply
from mortal.controller.backends.local import LocalBackend
from mortal.controller.snapshot import CODE_ANNOTATION
from mortal.state import open_store, paths


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def test_delete_run_keeps_checkpoints_by_default(cli, store, mortal_home):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("delete", "run", "quickstart")
    assert out.exit_code == 0, out.output
    said = "trainingrun/quickstart deleted (the controller stops its workers, then moves its checkpoints to "
    assert out.stdout.startswith(said), "the move is the controller's, later: it is not said to be done"
    assert str(mortal_home / "deleted") in out.stdout
    assert "watched folder" not in out.stderr  # applied by hand: nothing brings it back
    row = store.get_run("quickstart")
    assert row.deleted_at is not None and not row.purge_requested
    assert cli("get", "runs").stdout.splitlines()[1].split()[1] == "Terminating"


@pytest.mark.parametrize("purge", [[], ["--purge"]], ids=["kept", "purged"])
def test_delete_of_a_run_whose_folder_is_a_link_says_its_files_stay_where_they_are(
    cli, store, mortal_home, tmp_path, purge
):
    """The controller never follows a run's folder that is a link (out of MORTAL_HOME, or to another run's
    folder): it neither moves nor removes it. Delete says so, as the Warning event will, rather than
    promise a move or a purge that will not happen."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoints").mkdir(parents=True)
    cli("apply", "-f", str(QUICKSTART))
    shutil.rmtree(paths.run_dir("quickstart"), ignore_errors=True)
    paths.runs_dir().mkdir(parents=True, exist_ok=True)
    paths.run_dir("quickstart").symlink_to(elsewhere)
    out = cli("delete", "run", "quickstart", *purge)
    assert out.exit_code == 0, out.output
    said = (
        "trainingrun/quickstart deleted (the controller stops its workers and leaves its files where they are"
    )
    assert out.stdout.startswith(said) and str(elsewhere.resolve()) in out.stdout
    assert "moves" not in out.stdout and "purges" not in out.stdout
    assert str(mortal_home / "deleted") not in out.stdout


def test_apply_right_after_delete_waits_for_the_purge_and_creates_a_new_run(cli, store, monkeypatch):
    """`delete` then `apply` at once: apply waits while the controller stops the old run's workers and purges
    it (a thread does it here, half a second after apply starts waiting, however long apply's checks took),
    then creates the run anew: a new uid."""
    cli("apply", "-f", str(QUICKSTART))
    old = store.get_run("quickstart").uid
    assert cli("delete", "run", "quickstart").exit_code == 0
    waits = apply.wait_until_deleted

    def purged_later(*args, **kwargs) -> None:
        purge = threading.Timer(0.5, store.purge_run, args=("quickstart",))
        purge.start()
        try:
            waits(*args, **kwargs)
        finally:
            purge.join()

    monkeypatch.setattr(apply, "wait_until_deleted", purged_later)
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.exit_code == 0, out.output
    assert out.stdout == "trainingrun/quickstart created\n"
    assert "is being deleted: waiting for the controller to finish" in out.stderr
    assert store.get_run("quickstart").uid != old


def test_apply_of_a_run_left_terminating_with_no_controller_starts_one_to_finish_the_purge(
    cli, store, monkeypatch, mortal_home, store_url
):
    """`delete --no-controller` (or a controller killed mid-delete) leaves the run Terminating with nobody to
    purge it: the next `apply` of that name starts a controller before it waits, not waiting for none."""
    import mortal.controller.manager as manager

    cli("apply", "-f", str(QUICKSTART))
    old = store.get_run("quickstart").uid
    assert cli("delete", "run", "quickstart", "--no-controller").exit_code == 0
    started, purges = [], []

    def controller_that_purges(state_url=None, **kwargs):
        if started:  # apply's own start at its end: the controller runs already
            return None
        started.append(state_url)
        purges.append(threading.Timer(0.2, store.purge_run, args=("quickstart",)))
        purges[0].start()
        return manager.StartedController(4242, mortal_home / "controller.log")

    monkeypatch.setattr(manager, "ensure_background_controller", controller_that_purges)
    monkeypatch.delenv("MORTAL_NO_CONTROLLER")
    out = cli("apply", "-f", str(QUICKSTART))
    for purge in purges:
        purge.join()
    assert out.exit_code == 0, out.output
    assert started == [store_url], "no controller was started to finish the deletion"
    assert "controller started (pid 4242" in out.stderr
    assert store.get_run("quickstart").uid != old


def test_apply_right_after_delete_installs_the_new_runs_code_in_a_folder_of_its_own(
    cli, store, spec_file, tmp_path, monkeypatch
):
    """The purge moves the deleted run's folder aside (Backend.set_aside_run_folder): apply waits for it
    before it installs the code snapshot, or the snapshot would go with the old folder."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "myrewards.py").write_text(
        "def correct(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    )
    monkeypatch.chdir(project)
    spec = spec_file("mine", **{"spec.rewards": [{"function": "myrewards:correct"}]})
    assert cli("apply", "-f", str(spec)).exit_code == 0
    old = store.get_run("mine")
    assert cli("delete", "run", "mine").exit_code == 0

    waits = apply.wait_until_deleted

    def purged_while_waiting(*args, **kwargs) -> None:  # the controller purges as apply starts waiting
        LocalBackend().set_aside_run_folder("mine", old.uid)
        store.purge_run("mine")
        waits(*args, **kwargs)

    monkeypatch.setattr(apply, "wait_until_deleted", purged_while_waiting)
    out = cli("apply", "-f", str(spec))
    assert out.exit_code == 0, out.output
    new = store.get_run("mine")
    digest = new.annotations[CODE_ANNOTATION]
    assert new.uid != old.uid and (paths.code_dir("mine", digest) / "myrewards.py").is_file()
    assert (paths.kept_run_dir("mine", old.uid) / "code" / digest / "myrewards.py").is_file()


def test_delete_purge(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("delete", "tr", "quickstart", "--purge")
    said = "trainingrun/quickstart deleted (the controller stops its workers, then purges its checkpoints)\n"
    assert out.stdout == said
    assert store.get_run("quickstart").purge_requested


def test_deleting_a_run_of_a_watched_folder_says_its_file_brings_it_back(cli, store, tmp_path):
    from mortal.controller.watchdir import sync_folder

    folder = tmp_path / "live"
    folder.mkdir()
    (folder / "quickstart.yaml").write_text(QUICKSTART.read_text())
    assert sync_folder(store, folder).applied == {"quickstart": "created"}
    out = cli("delete", "run", "quickstart")
    assert out.exit_code == 0, out.output
    assert f"note: trainingrun/quickstart came from the watched folder {folder.resolve()}: " in out.stderr
    assert "remove the file to delete it for good" in out.stderr


def test_delete_missing_run(cli):
    out = cli("delete", "run", "nope")
    assert out.exit_code == 1 and out.stderr == "error: trainingrun 'nope' not found\n"
    quiet = cli("delete", "run", "nope", "--ignore-not-found")
    assert quiet.exit_code == 0 and quiet.stdout == ""


def test_delete_by_file(cli, spec_file, store, tmp_path):
    cli("apply", "-f", str(spec_file("a")))
    cli("apply", "-f", str(spec_file("b")))
    out = cli("delete", "-f", str(tmp_path))
    assert out.exit_code == 0, out.output
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["trainingrun/a", "trainingrun/b"]
    assert all(r.deleted_at is not None for r in store.list_runs())


def test_delete_needs_a_target(cli):
    assert cli("delete").exit_code == 2
    assert cli("delete", "-f", str(QUICKSTART), "run", "quickstart").exit_code == 2


def test_suspend_and_resume(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("suspend", "run", "quickstart")
    assert out.exit_code == 0 and out.stdout == "trainingrun/quickstart suspended\n"
    row = store.get_run("quickstart")
    assert row.spec["suspend"] is True and row.generation == 2
    assert (
        cli("suspend", "run", "quickstart").stdout == "trainingrun/quickstart unchanged (already suspended)\n"
    )
    out = cli("resume", "run", "quickstart")
    assert out.stdout == "trainingrun/quickstart resumed\n"
    row = store.get_run("quickstart")
    assert row.spec["suspend"] is False and row.generation == 3
    # the applied file does not set suspend, so applying it again changes nothing
    assert cli("apply", "-f", str(QUICKSTART)).stdout == "trainingrun/quickstart unchanged\n"


def test_applying_again_the_file_a_run_was_suspended_from_keeps_it_suspended(cli, store, spec_file):
    """As `kubectl apply` leaves a field the file never set: a file without `suspend` leaves the run's
    own (re-applying it does not resume the run); a file that sets it decides."""
    cli("apply", "-f", str(QUICKSTART))
    assert cli("suspend", "run", "quickstart").exit_code == 0
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.stdout == "trainingrun/quickstart unchanged\n"
    assert store.get_run("quickstart").spec["suspend"] is True
    out = cli("apply", "-f", str(spec_file("quickstart", **{"spec.suspend": False})))
    assert out.stdout == "trainingrun/quickstart configured\n"
    assert store.get_run("quickstart").spec["suspend"] is False


def test_a_finished_run_cannot_be_suspended(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    set_status(store, "quickstart", phase="Succeeded")
    out = cli("suspend", "run", "quickstart")
    assert out.exit_code == 1 and "is Succeeded" in out.stderr


def test_suspend_missing_and_deleted_runs(cli):
    assert cli("suspend", "run", "nope").exit_code == 1
    cli("apply", "-f", str(QUICKSTART))
    cli("delete", "run", "quickstart")
    out = cli("resume", "run", "quickstart")
    assert out.exit_code == 1 and "being deleted" in out.stderr
