"""Calls with a deadline: a value or an exception comes back as from a plain call; past the deadline the call
is abandoned with every thread's stack in the log; too many abandoned calls still running ask for a relaunch;
SIGUSR1 makes a worker write its stacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mortal.workers.deadline import Abandoner, CallExited, CallTimedOut, TooManyAbandonedCalls


def _blocks_until(event: threading.Event) -> None:
    event.wait()


def test_a_call_within_its_deadline_returns_its_value_or_raises_its_exception() -> None:
    calls = Abandoner()
    assert calls.call(lambda a, b=0: a + b, 5.0, "add", 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        calls.call(lambda: 1 / 0, 5.0, "divide")
    assert calls.abandoned == 0


@pytest.mark.parametrize("raised", [SystemExit(0), KeyboardInterrupt("ctrl-c")])
def test_a_call_s_own_exit_comes_back_as_an_error_naming_it_not_as_the_worker_s_end(raised) -> None:
    """User code calling sys.exit (or raising KeyboardInterrupt) must not end the worker as if it finished."""

    def leaves() -> None:
        raise raised

    with pytest.raises(CallExited) as caught:
        Abandoner().call(leaves, 5.0, "reward r")
    assert caught.value.raised is raised and str(caught.value).startswith(
        f"reward r raised {type(raised).__name__}"
    )


def test_a_call_s_os_exit_comes_back_as_an_error_and_the_worker_lives() -> None:
    with pytest.raises(CallExited, match=r"^reward r called os._exit\(3\)$") as caught:
        Abandoner().call(lambda: os._exit(3), 5.0, "reward r")
    assert isinstance(caught.value.raised, SystemExit) and caught.value.raised.code == 3


def test_a_child_forked_inside_a_call_still_exits_with_os_exit() -> None:
    """multiprocessing's forked child ends with os._exit: in the child it must be the real one."""
    import multiprocessing

    def forks() -> int | None:
        child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
        child.start()
        child.join(30)
        return child.exitcode

    assert Abandoner().call(forks, 60.0, "reward forks") == 0


def test_os_exit_outside_a_call_is_the_real_one() -> None:
    """The worker's own end (workers/main.py) still exits: only a call's thread is guarded."""
    script = "from mortal.workers.deadline import Abandoner\nimport os\nAbandoner()\nos._exit(7)"
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == 7


def test_a_call_past_its_deadline_is_abandoned_and_every_stack_goes_to_the_log(capfd) -> None:
    calls, release = Abandoner(), threading.Event()
    started = time.monotonic()
    with pytest.raises(CallTimedOut, match=r"reward slow did not return within 0.2 s"):
        calls.call(_blocks_until, 0.2, "reward slow", release)
    assert time.monotonic() - started < 2
    assert calls.abandoned == 1
    err = capfd.readouterr().err
    assert "--- stacks of every thread: reward slow still running after" in err
    assert "in _blocks_until" in err  # the stuck frame, named
    release.set()
    deadline = time.monotonic() + 10
    while calls.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.abandoned == 0  # a call that ends after all is no longer counted


def test_too_many_abandoned_calls_still_running_ask_for_a_relaunch() -> None:
    calls, release = Abandoner(limit=2), threading.Event()
    for _ in range(2):
        with pytest.raises(CallTimedOut):
            calls.call(_blocks_until, 0.05, "tool hang", release)
    with pytest.raises(TooManyAbandonedCalls, match="2 calls past their deadline are still running"):
        calls.call(lambda: 1, 5.0, "tool fine")
    release.set()


WORKER = """
import sys, threading, time
from mortal.workers.deadline import register_stack_dump
assert register_stack_dump()
def stuck_in_a_socket_read():
    print("ready", flush=True)
    time.sleep(60)
stuck_in_a_socket_read()
"""


def test_sigusr1_makes_a_worker_write_every_threads_stack(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, stderr=out)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "stuck_in_a_socket_read" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the signal must not end the worker"
    finally:
        proc.kill()
        proc.wait()
    assert "(most recent call first)" in log.read_text() and "in stuck_in_a_socket_read" in log.read_text()
