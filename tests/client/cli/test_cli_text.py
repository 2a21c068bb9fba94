"""Text from the store reaches the terminal as text: every verb, fed hostile events, labels, messages,
completions, metric names and log lines, prints no ESC byte (nor C1 control, nor bidi override) and
reads no rich markup; -o json/yaml still carry the exact text."""

from __future__ import annotations

import json

import pytest
from clihelpers import actor, set_status
from ruamel.yaml import YAML

from mortal.client.cli.text import plain
from mortal.state import NewCompletion, open_store, paths

MARKUP = "[bold red]LOUD[/bold red]"
HOSTILE = (
    "\x1b[2J\x1b[H\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07" + MARKUP + "\x9b31m\u202eevil\x07\r"
    "\x1b[31m"
)
HOSTILE_LINES = HOSTILE + "\nsecond line\x1b[0m"
RAW = ("\x1b", "\x9b", "\u202e", "\x07", "\r")


def shown_as_text(output: str, shows_hostile: bool = True) -> None:
    """No raw control character a terminal would obey, and the markup printed as written."""
    for raw in RAW:
        assert raw not in output, (raw, output)
    if not shows_hostile:
        return
    assert MARKUP in output, output
    assert "^[[2J" in output  # what was there stays visible, as kubectl and cat -v show it


def test_plain_shows_controls_and_keeps_text():
    assert plain("a\x1b[31mb\x9bc\u202ed\x7f\x00") == "a^[[31mb\\x9bc\\u202ed^?^@"
    assert plain("one\ntwo\tthree\r") == "one\\ntwo\\tthree\\r"
    assert plain("one\ntwo\tthree", multiline=True) == "one\ntwo\tthree"
    assert plain(MARKUP + " ünïcødé 漢字") == MARKUP + " ünïcødé 漢字"
    assert plain(None) == ""


@pytest.fixture
def hostile_run(cli, store_url, spec_file, mortal_home):
    """A Failed run whose every stored text is HOSTILE: labels, annotations, status and condition messages,
    an event, a worker's exit message, a checkpoint path, a completion, a metric name and a log line."""
    labels = {"team": "rl"}
    annotations = {"note": HOSTILE_LINES}
    assert (
        cli(
            "apply",
            "-f",
            str(spec_file("evil", **{"metadata.labels": labels, "metadata.annotations": annotations})),
        ).exit_code
        == 0
    )
    store = open_store(store_url)
    try:
        ref = actor(store, "evil")
        store.record_checkpoint(ref, 2, "/ckpt/" + HOSTILE, 2)
        store.add_metrics(ref, 1, {"loss": 0.5, "reward": 0.1, HOSTILE: 1.0})
        store.add_completions(
            ref,
            1,
            [
                NewCompletion(
                    sample=0,
                    prompt="user: " + HOSTILE + MARKUP,
                    completion=HOSTILE_LINES,
                    rewards={"correct_answer": 1.0},
                    reward=1.0,
                    advantage=0.5,
                    weight_version=1,
                )
            ],
        )
        store.add_event("evil", "Warning", "Odd" + HOSTILE, HOSTILE_LINES)
        store.report_exit(ref, "Failed", 1, HOSTILE_LINES)
        set_status(
            store,
            "evil",
            phase="Failed",
            observedGeneration=1,
            step=1,
            message=HOSTILE_LINES,
            conditions=[
                {"type": "Ready", "status": "False", "reason": "WorkerFailed", "message": HOSTILE_LINES}
            ],
        )
    finally:
        store.close()
    log = paths.worker_log("evil", "actor", 0, 1)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 1 " + HOSTILE + "\n", encoding="utf-8")
    return spec_file("evil", **{"metadata.labels": labels, "metadata.annotations": annotations})


QUIET = [
    ("get", "runs"),
    ("get", "runs", "-o", "wide"),
    ("get", "runs", "-o", "name"),
]  # names are DNS labels
VERBS = [
    ("get", "events"),
    ("get", "events", "evil"),
    ("get", "checkpoints", "evil"),
    ("get", "completions", "evil"),
    ("get", "metrics", "evil", "--name", "all"),
    ("describe", "run", "evil"),
    ("logs", "evil"),
]


@pytest.mark.parametrize("verb", VERBS + QUIET, ids=" ".join)
def test_every_verb_prints_store_text_as_text(cli, hostile_run, verb):
    out = cli(*verb)
    assert out.exit_code == 0, out.output
    shown_as_text(out.stdout + out.stderr, shows_hostile=verb not in QUIET)


def test_follow_and_errors_print_store_text_as_text(cli, hostile_run):
    followed = cli("apply", "-f", str(hostile_run), "--follow", "--timeout", "10")
    assert followed.exit_code == 1  # the run Failed: its message, on stderr
    shown_as_text(followed.stdout + followed.stderr)
    error = cli("get", "metrics", "evil", "--name", "zzz")  # the error lists the recorded names
    assert error.exit_code == 1
    assert all(raw not in error.stderr for raw in RAW) and "^[[2J" in error.stderr


def test_json_and_yaml_carry_the_exact_text(cli, hostile_run):
    events = cli("get", "events", "evil", "-o", "json").stdout
    assert all(raw not in events for raw in RAW)  # escaped by JSON itself (\u001b, \u009b, ...)
    assert json.loads(events)["items"][-1]["message"] == HOSTILE_LINES
    text = cli("get", "run", "evil", "-o", "yaml").stdout
    assert [raw for raw in RAW if raw in text] == [], text  # bidirectional marks escaped too
    run = YAML(typ="safe").load(text)
    assert (
        run["metadata"]["annotations"]["note"] == HOSTILE_LINES and run["status"]["message"] == HOSTILE_LINES
    )
    completions = json.loads(cli("get", "completions", "evil", "-o", "json").stdout)
    assert completions["items"][0]["completion"] == HOSTILE_LINES
    metrics = json.loads(cli("get", "metrics", "evil", "--name", "all", "-o", "json").stdout)
    assert HOSTILE in metrics["items"][0]["values"]


def test_controller_status_prints_the_stored_lease_holder_as_text(cli, store_url):
    from mortal.controller.leader import LEASE_NAME

    store = open_store(store_url)
    try:
        assert store.acquire_lease(LEASE_NAME, "host-1 " + HOSTILE, 60.0) is not None
    finally:
        store.close()
    out = cli("controller", "status")
    assert out.exit_code == 0, out.output
    shown_as_text(out.stdout + out.stderr, shows_hostile=False)
    assert "held by host-1 ^[[2J" in out.stdout


def test_a_foreground_controller_logs_a_file_name_s_escape_as_text(tmp_path, capsys):
    """A watched folder's file may be named with ESC: the foreground controller's log (on the terminal)
    shows it as `^[`, as every verb shows stored text."""
    import logging

    from mortal.client.cli.text import PlainFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(PlainFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("mortal.test.plain")
    logger.addHandler(handler)
    try:
        logger.error("%s: invalid YAML\n  at line 2", tmp_path / "w\x1b[2J.yaml")
    finally:
        logger.removeHandler(handler)
    said = capsys.readouterr().err
    assert "\x1b" not in said and f"ERROR {tmp_path}/w^[[2J.yaml: invalid YAML\n  at line 2" in said
