"""`mortalctl apply` starts a controller in the background when none runs; one at most; it waits until
that one says it started, or reports it died; it exits gracefully on SIGTERM (workers keep running) and
by itself when idle. On SQLite only: starting and stopping the controller does not depend on the store
(tests/store_kinds.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.controller import manager
from mortal.controller.errors import ControllerStartFailed
from mortal.controller.leader import LEASE_NAME
from mortal.workers.simulated import simulated_run


@sqlite_only
def test_background_controller_starts_once_runs_a_run_and_stops_on_sigterm(harness):  # noqa: F811
    h = harness
    h.apply(simulated_run("bg", max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    started = manager.ensure_background_controller(h.url)
    assert started is not None and started.ready
    pid, log = started.pid, started.log
    try:
        assert manager.running_controller_pid() == pid
        assert manager.ensure_background_controller(h.url) is None  # one is running: not a second
        wait_for(
            lambda: (lease := h.store.get_lease(LEASE_NAME)) and lease.holder.split(":")[1] == str(pid),
            30,
            "the background controller to lead",
        )
        wait_for(lambda: h.status("bg").get("phase") == "Running", 30, "the run to start")
        workers = {p.pid for p in worker_processes(h.home)}
        os.kill(pid, signal.SIGTERM)
        assert psutil.Process(pid).wait(30) == 0
        assert {p.pid for p in worker_processes(h.home)} == workers, "stopping the controller stopped workers"
        assert manager.running_controller_pid() is None
        assert "stopped; workers keep running" in log.read_text()
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
    h.start()  # the next controller adopts and cleans up
    h.store.mark_deleted("bg")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")


@sqlite_only
def test_a_controller_that_dies_while_starting_is_an_error_with_the_end_of_its_log(
    harness,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """A controller whose interpreter imports a broken mortal exits at once: the client that started it
    is told its exit status and this start's last log lines (not an earlier controller's), and no pid
    file is left naming it."""
    broken = tmp_path / "broken" / "mortal"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise RuntimeError("this mortal is broken")\n')
    monkeypatch.setenv("PYTHONPATH", str(broken.parent))
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # not the working folder's mortal either
    manager.log_file().write_text("an earlier controller's line\n")
    with pytest.raises(ControllerStartFailed) as failed:
        manager.ensure_background_controller(harness.url)
    assert failed.value.status == 1 and failed.value.log == manager.log_file()
    assert "RuntimeError: this mortal is broken" in failed.value.tail
    assert "an earlier controller's line" not in failed.value.tail
    assert "exited with status 1 while starting" in str(failed.value)
    assert not psutil.pid_exists(failed.value.pid)
    assert not manager.pid_file().exists()


@sqlite_only
def test_a_controller_not_ready_in_time_is_reported_as_still_starting(harness, monkeypatch):  # noqa: F811
    monkeypatch.setattr(manager, "START_TIMEOUT_SECONDS", 0.0)
    started = manager.ensure_background_controller(harness.url)
    assert started is not None and not started.ready
    try:
        assert manager.running_controller_pid() == started.pid
    finally:
        assert manager.stop_controller() == (started.pid, False)


@sqlite_only
def test_idle_background_controller_exits_by_itself(harness):  # noqa: F811
    h = harness
    proc = h.spawn("--idle-exit", "1")
    assert proc.wait(timeout=30) == 0


@sqlite_only
def test_a_live_lease_elsewhere_means_no_new_controller(harness):  # noqa: F811
    h = harness
    h.store.acquire_lease(LEASE_NAME, "elsewhere:1:x", 30)
    assert manager.ensure_background_controller(h.url) is None
    assert not manager.pid_file().exists()


@sqlite_only
def test_a_controller_killed_with_sigkill_is_replaced_at_once_though_its_lease_has_not_expired(
    harness,  # noqa: F811
):
    """The lease of a controller of this host whose process is gone stands for no controller: the next
    `apply` starts one (which leads once the lease expires) instead of leaving the run unsupervised."""
    h = harness
    h.apply(simulated_run("bg-kill", max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    pids = []
    try:
        first = manager.ensure_background_controller(h.url).pid
        pids.append(first)
        wait_for(
            lambda: (lease := h.store.get_lease(LEASE_NAME)) and lease.holder.split(":")[1] == str(first),
            30,
            "the first controller to lead",
        )
        os.kill(first, signal.SIGKILL)
        psutil.Process(first).wait(10)
        started = manager.ensure_background_controller(h.url)  # the lease is still unexpired
        assert started is not None, "no controller started after the last one was killed"
        pids.append(started.pid)
        wait_for(
            lambda: h.store.get_lease(LEASE_NAME).holder.split(":")[1] == str(started.pid),
            30,
            "the new controller to lead",
        )
    finally:
        for pid in pids:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)
    h.start()  # the next controller adopts and cleans up
    h.store.mark_deleted("bg-kill")
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")


def test_a_lease_of_a_process_of_this_host_that_is_gone_is_no_controller():
    """holder_gone_here: only this host's holders whose pid runs no process; another host's or a live
    process's lease stands."""
    from mortal.controller.leader import holder_gone_here, new_holder

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = socket.gethostname()
    assert holder_gone_here(f"{here}:{gone.pid}:abc")
    assert not holder_gone_here(new_holder())  # this process
    assert not holder_gone_here(f"elsewhere-{here}:{gone.pid}:abc")
    assert not holder_gone_here("garbage")


def test_python_m_mortal_controller_help():
    out = subprocess.run(
        [sys.executable, "-m", "mortal.controller", "--help"], capture_output=True, text=True, check=True
    )
    assert "--watch" in out.stdout and "--idle-exit" in out.stdout
