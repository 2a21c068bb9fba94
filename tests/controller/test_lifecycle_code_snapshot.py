"""A run carries its code: a controller started in one folder runs a run applied from another, whose reward
module lives only there; the rollout imports it from the run's snapshot. `mortalctl controller status | stop`
tell about and stop that controller, leaving its workers to the next one. On SQLite only: the subject is the
controller and the CLI (tests/store_kinds.py)."""

from __future__ import annotations

import os
import signal
import socket

import psutil
import pytest
from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only
from typer.testing import CliRunner

from mortal.client.cli.main import app
from mortal.controller import manager
from mortal.controller.snapshot import CODE_ANNOTATION
from mortal.state import paths

REWARDS = """
import os
import pathlib

if os.environ.get("MORTAL_ROLE"):  # imported by a worker: say from where
    pathlib.Path(os.environ["MORTAL_HOME"], "imported-" + os.environ["MORTAL_ROLE"]).write_text(__file__)


def correct(completions, prompts=None, **kwargs):
    return [1.0 for _ in completions]
"""

RUN = """
apiVersion: mortal/v1
kind: TrainingRun
metadata:
  name: {name}
  annotations: {{mortal.dev/workload: simulated, mortal.dev/step-seconds: "{step_seconds}",
                mortal.dev/rewards: call}}
spec:
  model: {{name: simulated}}
  dataset: {{name: builtin:arith}}
  algorithm: {{numGenerations: 2, batchSize: 4, maxSteps: {max_steps}}}
  rewards: [{{function: "myrewards:correct"}}]
  checkpoint: {{every: 2, keep: 2}}
"""


@pytest.fixture
def folders(tmp_path, monkeypatch):
    user, elsewhere = tmp_path / "user", tmp_path / "elsewhere"
    user.mkdir()
    elsewhere.mkdir()
    (user / "myrewards.py").write_text(REWARDS)
    monkeypatch.setenv("MORTAL_NO_CONTROLLER", "1")
    return user, elsewhere


def mortalctl(h, *args: str):
    return CliRunner().invoke(app, ["--state-url", h.url, *args])


@sqlite_only
def test_the_rollout_imports_the_reward_from_the_runs_snapshot_not_the_controllers_folder(
    harness,  # noqa: F811
    folders,
    monkeypatch,
):
    h, (user, elsewhere) = harness, folders
    monkeypatch.chdir(elsewhere)
    h.spawn()  # the controller the quickstart left running, started in another folder
    monkeypatch.chdir(user)
    (user / "run.yaml").write_text(RUN.format(name="mine", step_seconds=0.05, max_steps=3))
    out = mortalctl(h, "apply", "-f", "run.yaml")
    assert out.exit_code == 0, out.output
    h.wait_phase("mine", "Succeeded", 60)
    snapshot = paths.code_dir("mine", h.store.get_run("mine").annotations[CODE_ANNOTATION])
    assert (h.home / "imported-rollout").read_text() == str(snapshot / "myrewards.py")


@sqlite_only
def test_controller_status_and_stop_leave_the_workers_to_the_next_controller(  # noqa: F811
    harness,  # noqa: F811
    folders,
    monkeypatch,
):
    h, (user, elsewhere) = harness, folders
    assert "controller: not running" in mortalctl(h, "controller", "status").stdout
    monkeypatch.chdir(elsewhere)
    proc = h.spawn()
    wait_for(lambda: manager.running_controller_pid() == proc.pid, 30, "the controller's pid file")
    monkeypatch.chdir(user)
    (user / "run.yaml").write_text(RUN.format(name="long", step_seconds=0.2, max_steps=100_000))
    assert mortalctl(h, "apply", "-f", "run.yaml").exit_code == 0
    h.wait_phase("long", "Running", 60)
    status = mortalctl(h, "controller", "status").stdout
    assert f"controller: running (pid {proc.pid}, since " in status
    assert f"started in: {elsewhere}" in status and f"home: {h.home}" in status
    assert f"leader lease: held by {socket.gethostname()}:{proc.pid}:" in status
    workers = {p.pid for p in worker_processes(h.home)}
    stopped = mortalctl(h, "controller", "stop")
    assert stopped.exit_code == 0
    assert f"controller (pid {proc.pid}) stopped; workers keep running" in stopped.stdout
    assert not psutil.pid_exists(proc.pid)  # (stop reaped it: this test process is its parent)
    assert {p.pid for p in worker_processes(h.home)} == workers
    assert "controller: not running" in mortalctl(h, "controller", "status").stdout
    assert "no controller running" in mortalctl(h, "controller", "stop").stdout
    frozen = h.spawn()  # one that cannot finish on SIGTERM is killed after --timeout
    wait_for(lambda: manager.running_controller_pid() == frozen.pid, 30, "the second controller's pid file")
    os.kill(frozen.pid, signal.SIGSTOP)
    killed = mortalctl(h, "controller", "stop", "--timeout", "1")
    assert f"controller (pid {frozen.pid}) killed after 1s" in killed.stdout, killed.output
    assert not psutil.pid_exists(frozen.pid) and manager.running_controller_pid() is None
    h.start()  # the next controller adopts the workers and cleans up
    h.store.mark_deleted("long")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")
