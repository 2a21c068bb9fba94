"""`apply --follow/--wait` and the follow view MortalTrainer shares: step lines, outcome, snippet."""

from __future__ import annotations

import io
import threading
import time

import pytest
from clihelpers import QUICKSTART, actor, set_status
from rich.console import Console

from mortal.client.cli import follow
from mortal.client.cli.context import CliError
from mortal.state import open_store


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def finish(store, phase="Succeeded", steps=3, checkpoint="/ckpt/quickstart/step-3", message=None):
    ref = actor(store, "quickstart")
    for step in range(1, steps + 1):
        store.add_metrics(
            ref, step, {"reward": 0.1 * step, "loss": 1.0, "weight_version": step, "step_seconds": 2.5}
        )
    status = {"phase": phase, "step": steps, "reward": 0.1 * steps, "message": message}
    if checkpoint:
        status["lastCheckpoint"] = {"step": steps, "path": checkpoint}
    set_status(store, "quickstart", **status)


def test_follow_prints_a_line_per_step_then_the_checkpoint_and_snippet(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    finish(store)
    out = cli("apply", "-f", str(QUICKSTART), "--follow")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == "trainingrun/quickstart unchanged"
    steps = [line for line in lines if line.startswith("step ")]
    assert steps == [
        f"step {i}/30  reward {0.1 * i:.3f}  loss 1.0000  weights v{i}  2.5s/step" for i in (1, 2, 3)
    ]
    assert "trainingrun/quickstart Succeeded: 3/30 steps, reward 0.300" in out.stdout
    assert "final checkpoint: /ckpt/quickstart/step-3" in out.stdout
    assert "AutoModelForCausalLM.from_pretrained('/ckpt/quickstart/step-3')" in out.stdout


def test_wait_is_quiet_and_a_failed_run_exits_1(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    finish(store, phase="Failed", checkpoint=None, message="reward my.mod:f raised ValueError")
    out = cli("apply", "-f", str(QUICKSTART), "--wait")
    assert out.exit_code == 1
    assert "step " not in out.stdout
    assert "trainingrun/quickstart Failed: reward my.mod:f raised ValueError" in out.stderr


def test_a_failure_message_is_one_escaped_line_so_user_code_cannot_forge_a_status_line(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    raised = "bad \x1b[2J\r\u202eevil\u202c\ntrainingrun/quickstart Succeeded: 30/30 steps"
    finish(store, phase="Failed", checkpoint=None, message=f"reward raised ValueError: {raised}")
    out = cli("apply", "-f", str(QUICKSTART), "--follow")
    assert out.exit_code == 1
    last = out.stderr.splitlines()[-1]
    assert last == (
        "trainingrun/quickstart Failed: reward raised ValueError: "
        "bad ^[[2J\\r\\u202eevil\\u202c\\ntrainingrun/quickstart Succeeded: 30/30 steps"
    )
    assert "Succeeded" not in out.stdout


def test_the_final_checkpoint_path_is_printed_on_one_line(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    finish(store, checkpoint="/ckpt/quick\nstart/step-3")
    out = cli("apply", "-f", str(QUICKSTART), "--follow")
    assert out.exit_code == 0, out.output
    assert "final checkpoint: /ckpt/quick\\nstart/step-3\n" in out.stdout


def test_follow_timeout_is_a_user_error(cli):
    out = cli("apply", "-f", str(QUICKSTART), "--wait", "--timeout", "0.5")
    assert out.exit_code == 1
    assert "timed out waiting for trainingrun/quickstart (phase Pending, step 0/30)" in out.stderr


def test_follow_run_sees_progress_as_it_happens(cli, store, store_url, capsys):
    cli("apply", "-f", str(QUICKSTART))
    writer = open_store(store_url)

    def train():
        ref = actor(writer, "quickstart")
        for step in (1, 2):
            time.sleep(0.15)
            writer.add_metrics(ref, step, {"reward": step / 2})
            set_status(writer, "quickstart", phase="Running", step=step, reward=step / 2)
        time.sleep(0.15)
        set_status(writer, "quickstart", phase="Succeeded")

    thread = threading.Thread(target=train)
    thread.start()
    try:
        status = follow.follow_run(store, "quickstart", poll_seconds=0.05)
    finally:
        thread.join()
        writer.close()
    assert str(status.phase) == "Succeeded"
    printed = capsys.readouterr().out
    assert "step 1/30  reward 0.500" in printed and "step 2/30  reward 1.000" in printed


def test_follow_a_deleted_run_is_a_user_error(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    store.purge_run("quickstart")
    with pytest.raises(CliError, match="was deleted"):
        follow.follow_run(store, "quickstart", quiet=True, poll_seconds=0.01)


def test_status_stands_in_for_missing_reward_metrics(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    set_status(store, "quickstart", phase="Running", step=4, reward=0.25)
    follower = follow.Follower(store, "quickstart")
    assert follower.poll().new_steps == [(4, {"reward": 0.25, "weight_version": 0.0})]
    assert follower.poll().new_steps == []


def test_load_snippet_for_full_and_lora_checkpoints(tmp_path):
    full = follow.load_snippet(str(tmp_path))
    assert full.count("\n") == 2 and "AutoModelForCausalLM.from_pretrained" in full
    (tmp_path / "adapter_config.json").write_text("{}")
    lora = follow.load_snippet(str(tmp_path))
    assert lora.count("\n") == 2 and "AutoPeftModelForCausalLM.from_pretrained" in lora


def test_render_builds_a_terminal_view(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    finish(store)
    store.add_event("quickstart", "Normal", "Started", "workers started")
    follower = follow.Follower(store, "quickstart")
    snap = follower.poll()
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(follow.render(snap, follower))
    text = console.export_text()
    assert "trainingrun/quickstart" in text and "step 3/30" in text and "workers started" in text
