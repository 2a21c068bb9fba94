"""`mortalctl apply`: created / unchanged / configured, folders and stdin, errors, round trips."""

from __future__ import annotations

import json
import re

from clihelpers import QUICKSTART
from store_kinds import sqlite_only

from mortal.client import apply
from mortal.controller import manager
from mortal.state import open_store


def test_apply_twice_is_created_then_unchanged(cli):
    first = cli("apply", "-f", str(QUICKSTART))
    assert first.exit_code == 0, first.output
    assert first.stdout == "trainingrun/quickstart created\n"
    second = cli("apply", "-f", str(QUICKSTART))
    assert second.exit_code == 0, second.output
    assert second.stdout == "trainingrun/quickstart unchanged\n"


def test_editing_a_field_is_configured_and_bumps_generation(cli, spec_file, store_url):
    cli("apply", "-f", str(QUICKSTART))
    edited = cli("apply", "-f", str(spec_file(**{"spec.algorithm.maxSteps": 40})))
    assert edited.stdout == "trainingrun/quickstart configured\n"
    doc = json.loads(cli("get", "run", "quickstart", "-o", "json").stdout)
    assert doc["metadata"]["generation"] == 2
    assert doc["spec"]["algorithm"]["maxSteps"] == 40


def test_spelled_out_defaults_and_reordering_are_unchanged(cli, spec_file):
    cli("apply", "-f", str(QUICKSTART))
    same = spec_file(**{"spec.algorithm.beta": 0.0, "spec.backend": "local", "spec.sync.method": "auto"})
    assert cli("apply", "-f", str(same)).stdout == "trainingrun/quickstart unchanged\n"


def test_labels_alone_configure_without_new_generation(cli, spec_file, store_url):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("apply", "-f", str(spec_file(**{"metadata.labels": {"team": "rl"}})))
    assert out.stdout == "trainingrun/quickstart configured\n"
    store = open_store(store_url)
    try:
        row = store.get_run("quickstart")
        assert (row.generation, row.labels) == (1, {"team": "rl"})
    finally:
        store.close()


def test_apply_a_folder_and_several_files(cli, spec_file, tmp_path):
    spec_file("a")
    spec_file("b")
    out = cli("apply", "-f", str(tmp_path))
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == ["trainingrun/a created", "trainingrun/b created"]
    out = cli("apply", "-f", str(spec_file("c")), "-f", str(spec_file("a")))
    assert out.stdout.splitlines() == ["trainingrun/c created", "trainingrun/a unchanged"]


def test_apply_from_stdin(cli):
    out = cli("apply", "-f", "-", input=QUICKSTART.read_text())
    assert out.exit_code == 0, out.output
    assert out.stdout == "trainingrun/quickstart created\n"


def test_get_json_round_trips_through_apply(cli, spec_file):
    cli("apply", "-f", str(QUICKSTART))
    cli("apply", "-f", str(spec_file("other", **{"spec.rollout.replicas": 5})))
    dumped = cli("get", "runs", "-o", "json")
    assert json.loads(dumped.stdout)["kind"] in ("List", "TrainingRunList")
    again = cli("apply", "-f", "-", input=dumped.stdout)
    assert again.exit_code == 0, again.output
    # Nothing is written: the documents spell out what the runs have, without taking their fields over.
    assert again.stdout.splitlines() == ["trainingrun/other unchanged", "trainingrun/quickstart unchanged"]
    assert cli("get", "runs", "-o", "json").stdout == dumped.stdout


def test_get_yaml_of_one_run_round_trips_through_apply(cli):
    cli("apply", "-f", str(QUICKSTART))
    dumped = cli("get", "run", "quickstart", "-o", "yaml").stdout
    assert "apiVersion: mortal/v1" in dumped and "status:" in dumped
    assert cli("apply", "-f", "-", input=dumped).stdout == "trainingrun/quickstart unchanged\n"
    edited = dumped.replace("maxSteps: 30", "maxSteps: 31")
    assert cli("apply", "-f", "-", input=edited).stdout == "trainingrun/quickstart configured\n"
    assert cli("apply", "-f", "-", input=edited).stdout == "trainingrun/quickstart unchanged\n"  # again


def test_a_document_read_before_a_scale_does_not_undo_it(cli):
    """`get -o yaml` writes the generation it read; applying it after a scale would set the old replicas
    back, so it is refused, as kubectl refuses an object modified since it was read. Got again, it applies;
    without metadata.generation it is merged as a file written by hand."""
    cli("apply", "-f", str(QUICKSTART))
    dumped = cli("get", "run", "quickstart", "-o", "yaml").stdout
    assert cli("scale", "quickstart", "rollout=3").exit_code == 0
    out = cli("apply", "-f", "-", input=dumped.replace("maxSteps: 30", "maxSteps: 31"))
    assert out.exit_code == 1
    assert "trainingrun/quickstart has changed since the document was read (metadata.generation 1, now 2" in (
        out.stderr
    )
    assert '"replicas": 3' in cli("get", "run", "quickstart", "-o", "json").stdout  # the scale stands
    fresh = cli("get", "run", "quickstart", "-o", "yaml").stdout.replace("maxSteps: 30", "maxSteps: 31")
    assert cli("apply", "-f", "-", input=fresh).stdout == "trainingrun/quickstart configured\n"
    assert '"replicas": 3' in cli("get", "run", "quickstart", "-o", "json").stdout


def test_bad_spec_is_exit_1_with_file_and_line_and_no_traceback(cli, spec_file):
    bad = spec_file(**{"spec.algorithm.numGenerations": 1})
    out = cli("apply", "-f", str(bad))
    assert out.exit_code == 1
    assert out.stdout == ""
    assert f"{bad}:" in out.stderr and "numGenerations" in out.stderr
    assert out.stderr.startswith("error: ")
    assert "Traceback" not in out.stderr


def test_all_problems_of_all_files_are_reported_together(cli, spec_file):
    a = spec_file("a", **{"spec.algorithm.numGenerations": 1})
    b = spec_file("b", **{"spec.rollout.replicas": -1})
    out = cli("apply", "-f", str(a), "-f", str(b))
    assert out.exit_code == 1
    assert "2 problems" in out.stderr and str(a) in out.stderr and str(b) in out.stderr
    assert cli("get", "runs", "-o", "name").stdout == ""  # nothing was applied


def test_missing_file_and_empty_folder_are_user_errors(cli, tmp_path):
    missing = cli("apply", "-f", str(tmp_path / "nope.yaml"))
    assert missing.exit_code == 1 and "nope.yaml" in missing.stderr
    empty = cli("apply", "-f", str(tmp_path))
    assert empty.exit_code == 1 and "no TrainingRun documents" in empty.stderr


def test_same_run_twice_in_the_arguments_is_an_error_naming_where(cli, tmp_path):
    out = cli("apply", "-f", str(QUICKSTART), "-f", str(QUICKSTART))
    assert out.exit_code == 1
    assert f"run 'quickstart' is given more than once (2 times in {QUICKSTART})" in out.stderr
    copy = tmp_path / "copy.yaml"
    copy.write_text(QUICKSTART.read_text())
    out = cli("apply", "-f", str(QUICKSTART), "-f", str(copy))
    assert f"run 'quickstart' is given more than once (in {QUICKSTART}, {copy})" in out.stderr


def test_usage_errors_exit_2(cli):
    assert cli("apply", "--bogus", "-f", str(QUICKSTART)).exit_code == 2
    assert cli("apply").exit_code in (0, 2)  # no arguments: help
    assert cli("apply", "-f").exit_code == 2


def test_dry_run_writes_nothing(cli, spec_file):
    out = cli("apply", "-f", str(QUICKSTART), "--dry-run")
    assert out.stdout == "trainingrun/quickstart created (dry run)\n"
    assert cli("get", "runs", "-o", "name").stdout == ""
    cli("apply", "-f", str(QUICKSTART))
    edited = spec_file(**{"spec.algorithm.maxSteps": 40})
    assert (
        cli("apply", "-f", str(edited), "--dry-run").stdout == "trainingrun/quickstart configured (dry run)\n"
    )
    assert (
        cli("apply", "-f", str(QUICKSTART), "--dry-run").stdout
        == "trainingrun/quickstart unchanged (dry run)\n"
    )


def test_a_dry_run_over_a_run_being_deleted_says_apply_would_create_it_once_the_deletion_ends(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    store.mark_deleted("quickstart")
    out = cli("apply", "-f", str(QUICKSTART), "--dry-run")
    assert out.stdout == "trainingrun/quickstart created (once the deletion in progress ends) (dry run)\n"
    assert store.get_run("quickstart").deleted_at is not None  # still being deleted: nothing written


def test_a_run_refused_does_not_stop_the_others_and_is_named_with_its_file(
    cli, store_url, spec_file, tmp_path
):
    """As `kubectl apply -f DIR`: every run is applied that can be, each refused one is an error naming
    its file, and the exit is 1; --dry-run says the same, writing nothing."""
    from clihelpers import set_status

    folder = tmp_path / "runs"
    folder.mkdir()
    for name in ("a", "b", "c"):
        cli("apply", "-f", str(spec_file(name)))
    store = open_store(store_url)
    try:
        set_status(store, "b", phase="Succeeded", step=30)
    finally:
        store.close()
    for name in ("a", "b", "c"):
        spec_file(name, **{"spec.algorithm.maxSteps": 40}).rename(folder / f"{name}.yaml")
    for dry in (True, False):
        out = cli("apply", "-f", str(folder), *(["--dry-run"] if dry else []))
        suffix = " (dry run)" if dry else ""
        assert out.exit_code == 1
        assert out.stdout.splitlines() == [
            f"trainingrun/a configured{suffix}",
            f"trainingrun/c configured{suffix}",
        ]
        assert "trainingrun 'b' is Succeeded; a finished run cannot be changed" in out.stderr
        assert f"({folder})" in out.stderr
    store = open_store(store_url)
    try:
        maxima = [store.get_run(n).spec["algorithm"]["maxSteps"] for n in ("a", "b", "c")]
    finally:
        store.close()
    assert maxima == [40, 30, 40]


def test_a_fork_s_first_apply_says_that_it_keeps_what_the_file_leaves_out(cli, store_url, spec_file):
    """A run without a last-applied configuration (a fork, or one applied before mortal kept it) keeps
    every field the file leaves out this once; apply says so, as kubectl warns of a missing annotation."""
    cli("apply", "-f", str(QUICKSTART))
    store = open_store(store_url)
    try:
        row = store.get_run("quickstart")
        store.fork_run("child", row.spec, row.labels, row.annotations, "quickstart", 0, "/nowhere", 0)
    finally:
        store.close()
    child = spec_file("child")
    out = cli("apply", "-f", str(child))
    assert "note: trainingrun/child has no last-applied configuration" in out.stderr
    assert "note:" not in cli("apply", "-f", str(child)).stderr, "that apply recorded the file's fields"


def test_applying_to_a_run_still_being_deleted_gives_up_naming_it(cli, monkeypatch):
    """apply waits for a run of the name being deleted to be purged (test_cli_lifecycle.py), not forever."""
    monkeypatch.setattr(apply, "DELETION_WAIT_SECONDS", 0.3)
    cli("apply", "-f", str(QUICKSTART))
    cli("delete", "run", "quickstart")
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.exit_code == 1
    assert (
        "error: trainingrun/quickstart is still being deleted after 0.3s; is a controller running?"
        in out.stderr
    )


def test_apply_wakes_the_controller_and_starts_one(cli, monkeypatch, mortal_home, store_url):
    started = []

    def fake_start(state_url=None, **kwargs):
        started.append(state_url)
        return manager.StartedController(4242, mortal_home / "controller.log")

    monkeypatch.setattr(manager, "ensure_background_controller", fake_start)
    monkeypatch.delenv("MORTAL_NO_CONTROLLER")
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.exit_code == 0, out.output
    assert f"controller started (pid 4242, log: {mortal_home / 'controller.log'})" in out.stderr
    assert started == [store_url], "the controller is started on the store the CLI wrote to"
    assert (mortal_home / "wake" / "quickstart").exists()
    assert cli("apply", "-f", str(QUICKSTART), "--no-controller").exit_code == 0
    assert len(started) == 1
    monkeypatch.setattr(manager, "ensure_background_controller", lambda *a, **k: None)  # one runs already
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.exit_code == 0 and out.stderr == ""


@sqlite_only
def test_apply_says_controller_started_once_the_controller_it_started_is_up(cli, spec_file, monkeypatch):
    monkeypatch.delenv("MORTAL_NO_CONTROLLER")
    out = cli("apply", "-f", str(spec_file(**{"spec.suspend": True})))  # suspended: it launches nothing
    try:
        assert out.exit_code == 0, out.output
        started = re.search(r"controller started \(pid (\d+), log: (.+)\)", out.stderr)
        assert started is not None, out.stderr
        assert started[2] == str(manager.log_file())
        assert manager.running_controller_pid() == int(started[1])
    finally:
        assert manager.stop_controller() is not None


@sqlite_only
def test_apply_whose_controller_dies_while_starting_fails_naming_its_log_and_keeps_the_run(
    cli, monkeypatch, mortal_home
):
    """The controller started dies before it says it started (here: killed there by a failpoint): apply
    says so after what it applied, with the end of the controller's log, and exits 1; the run stays."""
    monkeypatch.delenv("MORTAL_NO_CONTROLLER")
    monkeypatch.setenv("MORTAL_FAILPOINT", "controller:before-ready")
    out = cli("apply", "-f", str(QUICKSTART))
    assert out.exit_code == 1
    assert out.stdout == "trainingrun/quickstart created\n"
    assert "controller started" not in out.stderr
    error = out.stderr[out.stderr.index("error: ") :]
    assert error.startswith("error: the background controller (pid ")
    assert f"was killed by SIGKILL while starting; the end of its log {manager.log_file()}:\n" in error
    assert manager.log_file().read_text().splitlines()[-1] in error  # its last line, as it is
    assert "an applied run stays applied" in error and "`mortalctl controller`" in error
    assert not manager.pid_file().exists()
    assert "quickstart" in cli("get", "runs").stdout


def test_a_model_that_cannot_fit_its_gpu_is_refused_naming_the_field(cli, spec_file, tmp_path):
    """14B parameters need 112 GB for weights + gradients + AdamW: an H100 (80 GB) can never hold them."""
    model = tmp_path / "model"
    model.mkdir()
    header = json.dumps(
        {
            f"layer{i}": {"dtype": "BF16", "shape": [1000, 1_000_000], "data_offsets": [0, 0]}
            for i in range(14)
        }
    ).encode()
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    big = spec_file(**{"spec.model.name": str(model), "spec.actor.gpu": "H100", "spec.rollout.gpu": "H100"})
    out = cli("apply", "-f", str(big))
    assert out.exit_code == 1
    assert (
        "trainingrun/quickstart: spec.actor.gpu: H100 has 80 GB; a model of 14.00B parameters" in out.output
    )
    assert "nothing was applied" in out.output
    assert "No resources found." in cli("get", "runs").output
    lora = spec_file(
        **{
            "spec.model.name": str(model),
            "spec.model.lora": {"r": 16},
            "spec.actor.gpu": "H100",
            "spec.rollout.gpu": "H100",
        }
    )
    assert cli("apply", "-f", str(lora)).stdout == "trainingrun/quickstart created\n"


def test_apply_and_scale_refuse_to_change_a_finished_run_and_say_to_fork_it(cli, store_url, spec_file):
    """A Succeeded run would not restart for a new spec: apply and scale refuse (exit 1) instead of
    answering `configured` for a change that never takes effect."""
    from clihelpers import set_status

    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    store = open_store(store_url)
    try:
        set_status(store, "quickstart", phase="Succeeded", step=30)
        longer = spec_file("quickstart", **{"spec.algorithm.maxSteps": 60})
        out = cli("apply", "-f", str(longer))
        assert out.exit_code == 1
        assert (
            "a finished run cannot be changed: fork it instead (mortalctl fork quickstart:step-30 NEW)"
            in (out.stderr)
        )
        out = cli("scale", "quickstart", "rollout=3")
        assert out.exit_code == 1 and "a finished run cannot be changed" in out.stderr
        assert store.get_run("quickstart").spec["algorithm"].get("maxSteps") != 60
    finally:
        store.close()


def test_a_change_the_workers_read_at_launch_says_when_it_takes_effect(cli, store_url, spec_file):
    """Workers read the model, algorithm, generation and rewards when they start: applying a change to a
    running run says which fields wait for their next start and how to get there; a scale (replicas) or a
    raised maxSteps is taken at once and says nothing."""
    from clihelpers import set_status

    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    store = open_store(store_url)
    try:
        set_status(store, "quickstart", phase="Running", step=3)
    finally:
        store.close()
    out = cli("apply", "-f", str(spec_file("quickstart", **{"spec.algorithm.learningRate": 1e-4})))
    assert out.exit_code == 0 and out.stdout == "trainingrun/quickstart configured\n"
    assert (
        "note: trainingrun/quickstart is Running: its workers read spec.algorithm.learningRate when "
        "they start" in out.stderr
    )
    assert "mortalctl suspend quickstart, then resume" in out.stderr
    out = cli(
        "apply",
        "-f",
        str(spec_file("quickstart", **{"spec.rollout.replicas": 3, "spec.algorithm.learningRate": 1e-4})),
    )
    assert out.exit_code == 0 and "its workers read" not in out.stderr


def test_only_fields_the_workers_read_at_launch_are_named() -> None:
    before = {
        "model": {"name": "a"},
        "rollout": {"replicas": 1, "maxToolCallingIterations": 3},
        "suspend": False,
    }
    after = {
        "model": {"name": "b"},
        "rollout": {"replicas": 4, "maxToolCallingIterations": 5},
        "suspend": True,
        "deadlines": {"stepSeconds": 60},
    }
    assert apply.fields_read_at_launch(before, after) == [
        "spec.model",
        "spec.rollout.maxToolCallingIterations",
    ]
