"""`mortalctl logs | schema | version | controller` and the help of every verb."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from clihelpers import QUICKSTART, set_status
from store_kinds import sqlite_only
from typer.testing import CliRunner

from mortal.client.cli.main import app
from mortal.state import open_store, paths

VERBS = [
    ["apply"],
    ["get"],
    ["get", "runs"],
    ["get", "events"],
    ["get", "checkpoints"],
    ["describe"],
    ["describe", "run"],
    ["scale"],
    ["delete"],
    ["delete", "run"],
    ["suspend"],
    ["suspend", "run"],
    ["resume"],
    ["resume", "run"],
    ["logs"],
    ["controller"],
    ["schema"],
    ["version"],
]


def write_log(run, role, replica, incarnation, lines):
    path = paths.worker_log(run, role, replica, incarnation)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


def test_root_help_lists_verbs_in_sections():
    out = CliRunner().invoke(app, ["--help"])
    assert out.exit_code == 0
    assert "Basic commands:" in out.stdout and "Operations:" in out.stdout
    for verb in (
        "apply",
        "get",
        "describe",
        "scale",
        "delete",
        "suspend",
        "resume",
        "logs",
        "controller",
        "schema",
    ):
        assert f"\n  {verb} " in out.stdout, verb


@pytest.mark.parametrize("verb", VERBS, ids=" ".join)
def test_every_verb_has_help_with_usage(verb):
    out = CliRunner().invoke(app, [*verb, "--help"])
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(f"Usage: mortalctl {' '.join(verb)}")
    assert "Traceback" not in out.output


def test_unknown_verb_and_flag_exit_2():
    assert CliRunner().invoke(app, ["frobnicate"]).exit_code == 2
    assert CliRunner().invoke(app, ["get", "pods"]).exit_code == 2
    assert CliRunner().invoke(app, ["--bogus", "version"]).exit_code == 2


def test_schema_is_json_schema():
    out = CliRunner().invoke(app, ["schema"])
    schema = json.loads(out.stdout)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert "metadata" in schema["properties"] and "spec" in schema["properties"]


def test_version():
    out = CliRunner().invoke(app, ["version"])
    assert out.exit_code == 0 and out.stdout.startswith("mortalctl ") and "mortal/v1" in out.stdout


def test_logs_of_every_worker_and_of_one(cli):
    cli("apply", "-f", str(QUICKSTART))
    write_log("quickstart", "actor", 0, 1, ["old actor line"])
    write_log("quickstart", "actor", 0, 3, ["step 1", "step 2", "step 3"])
    write_log("quickstart", "rollout", 0, 2, ["generated 8"])
    out = cli("logs", "quickstart")
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == [
        "[actor-0] step 1",
        "[actor-0] step 2",
        "[actor-0] step 3",
        "[rollout-0] generated 8",
    ]
    out = cli("logs", "quickstart", "--role", "actor", "--tail", "2")
    assert out.stdout.splitlines() == ["step 2", "step 3"]
    assert cli("logs", "quickstart", "--role", "rollout", "--replica", "0").stdout == "generated 8\n"


def test_logs_errors(cli):
    missing = cli("logs", "nope")
    assert missing.exit_code == 1 and "not found" in missing.stderr
    cli("apply", "-f", str(QUICKSTART))
    empty = cli("logs", "quickstart")
    assert empty.exit_code == 1 and "no logs of trainingrun/quickstart yet" in empty.stderr
    assert cli("logs", "quickstart", "--role", "critic").exit_code == 2
    beyond = cli("logs", "quickstart", "--role", "rollout", "--replica", "7")  # the quickstart has 2
    assert beyond.exit_code == 1
    assert "trainingrun/quickstart has no rollout replica 7: its replicas are 0..1" in beyond.stderr


@sqlite_only  # seconds of following log files; the store only tells the phase
def test_logs_follow_ends_when_the_run_finishes(cli, store_url):
    cli("apply", "-f", str(QUICKSTART))
    write_log("quickstart", "actor", 0, 1, ["step 1"])
    store = open_store(store_url)
    timer = threading.Timer(0.5, lambda: set_status(store, "quickstart", phase="Succeeded"))
    timer.start()
    try:
        out = cli("logs", "quickstart", "-f")
    finally:
        timer.join()
        store.close()
    assert out.exit_code == 0 and out.stdout == "step 1\n"


def test_controller_rejects_a_missing_watch_folder(cli, tmp_path):
    out = cli("controller", "--watch", str(tmp_path / "nope"))
    assert out.exit_code == 1 and "no such directory" in out.stderr


def test_unexpected_errors_are_one_line_unless_debug(cli, monkeypatch):
    import mortal.client.cli.get as get_module

    def boom(*args, **kwargs):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(get_module, "select_runs", boom)
    out = cli("get", "runs")
    assert out.exit_code == 1
    assert (
        out.stderr
        == "error: unexpected RuntimeError: something broke (run again with --debug for the traceback)\n"
    )
    out = cli("--debug", "get", "runs")
    assert out.exit_code == 1 and "Traceback" in out.stderr and "RuntimeError" in out.stderr


def test_what_a_worker_would_fail_the_run_with_is_a_user_error_not_an_unexpected_one() -> None:
    """`test rollout` runs a worker's code in the CLI: a spec mistake reads there as the run's reason, and a
    server that is down as itself."""
    from mortal.client.cli.error_messages import error_message
    from mortal.workers.rollout.environment_proxy import EnvironmentUnreachable
    from mortal.workers.rollout.tools import ToolLoadError

    refused = ToolLoadError("spec.rollout.tools: 'a:f' and 'b:f' are both the function 'f'", "ToolInvalid")
    assert (
        error_message(refused)
        == "error: ToolInvalid: spec.rollout.tools: 'a:f' and 'b:f' are both the function 'f'"
    )
    down = EnvironmentUnreachable("the environment server at http://envs:8000 is unreachable (refused)")
    assert error_message(down) == "error: the environment server at http://envs:8000 is unreachable (refused)"


def test_a_broken_state_url_is_a_user_error():
    out = CliRunner().invoke(app, ["--state-url", "postgresql://nobody@127.0.0.1:1/none", "get", "runs"])
    assert out.exit_code == 1
    assert out.stderr.startswith("error: cannot use the state store") and "Traceback" not in out.stderr


def test_a_password_in_the_state_url_is_never_printed():
    from mortal.client.cli.error_messages import error_message
    from mortal.state import StoreError
    from mortal.state.http_store import HttpStore

    url = "postgresql://u:SECRETPW@127.0.0.1:1/none"
    out = CliRunner().invoke(app, ["--state-url", url, "get", "runs"])
    assert out.exit_code == 1 and "SECRETPW" not in out.output, out.output
    assert "(postgresql://u:***@127.0.0.1:1/none)" in out.stderr
    store = HttpStore("http://u:SECRETPW@127.0.0.1:1", retry_seconds=0.1, retry_attempts=1)  # type: ignore[abstract]
    assert "SECRETPW" not in repr(store)
    with pytest.raises(StoreError) as down:
        store.list_runs()
    said = error_message(down.value)
    assert "SECRETPW" not in said and said.startswith(
        "error: state store at http://u:***@127.0.0.1:1 unreachable"
    )


def test_home_option_puts_the_default_store_there(tmp_path, monkeypatch):
    monkeypatch.delenv("MORTAL_STATE_URL", raising=False)
    home = tmp_path / "elsewhere"
    out = CliRunner().invoke(app, ["--home", str(home), "apply", "-f", str(QUICKSTART)])
    assert out.exit_code == 0, out.output
    assert (home / "state.db").exists()
    assert "quickstart" in CliRunner().invoke(app, ["--home", str(home), "get", "runs"]).stdout


@pytest.fixture
def modal_volume(tmp_path, monkeypatch):
    """The Modal fake as the `modal` package, with a token: its volume is a folder of this test."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "controller" / "backends"))
    from modal_fake import FakeModal

    fake = FakeModal(volume=tmp_path / "volume", functions={})
    monkeypatch.setitem(sys.modules, "modal", fake)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-test")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-test")
    yield fake
    fake.shutdown()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_logs_of_a_modal_run_are_read_from_its_volume(cli, spec_file, modal_volume, monkeypatch):
    assert cli("apply", "-f", str(spec_file(**{"spec.backend": "modal"}))).exit_code == 0
    write_log("quickstart", "actor", 0, 1, ["on this machine, not the run's"])
    assert_logs_are_read_from(cli, modal_volume.volume / "runs" / "quickstart" / "logs")
    modal_volume.unreachable = True
    broken = cli("logs", "quickstart")
    assert broken.exit_code == 1 and "could not read the logs from the Modal volume" in broken.stderr
    monkeypatch.delenv("MODAL_TOKEN_ID")
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(modal_volume.volume / "absent.toml"))
    no_token = cli("logs", "quickstart")
    assert no_token.exit_code == 1 and "modal token new" in no_token.stderr, no_token.stderr


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_logs_of_a_ray_run_without_shared_disk_are_read_from_its_storage(cli, spec_file, tmp_path):
    """ray.sharedFilesystem false: each worker's Ray actor uploads its node's log under
    <checkpoint.uri>/<run>/logs/ (controller/backends/ray_worker.py); `logs` reads them there, not under this
    machine's MORTAL_HOME."""
    bucket = tmp_path / "bucket"
    edits = {
        "spec.backend": "ray",
        "spec.ray": {"sharedFilesystem": False},
        "spec.checkpoint": {"uri": f"file://{bucket}"},
    }
    assert cli("apply", "-f", str(spec_file(**edits))).exit_code == 0
    write_log("quickstart", "actor", 0, 1, ["on this machine, not the run's"])
    assert cli("logs", "quickstart").exit_code == 1  # nothing uploaded yet
    assert_logs_are_read_from(cli, bucket / "quickstart" / "logs")


def assert_logs_are_read_from(cli, logs: Path) -> None:
    """Worker logs written under `logs` (as the run's workers leave them there) are what `logs` prints."""
    logs.mkdir(parents=True)
    (logs / "actor-0-2.log").write_text("step 1\nstep 2\n")
    (logs / "rollout-0-3.log").write_text("generated 8\n")
    out = cli("logs", "quickstart")
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines() == ["[actor-0] step 1", "[actor-0] step 2", "[rollout-0] generated 8"]
    assert cli("logs", "quickstart", "--role", "actor", "--tail", "1").stdout == "step 2\n"
