"""The Modal worker function's body (modal_worker): the worker's output teed to the container's stdout
and to its log file on the data volume, committed while it grows and once at the end, also when the
call is cancelled (through the Modal fake, whose containers run the body)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from modal_fake import FakeModal
from polling import wait_for

from mortal.controller.backends import WorkerLaunch
from mortal.controller.backends.modal import ModalBackend
from mortal.controller.backends.modal_worker import run_logged

PRINTS = (
    "import time\nfor i in range(4):\n    print('line', i, flush=True)\n    time.sleep(0.15)\n"
    "raise SystemExit(5)"
)
SERVES = "import time\nprint('serving', flush=True)\ntime.sleep(600)"


def test_output_goes_to_stdout_and_the_log_committed_as_it_grows(tmp_path: Path, capfd) -> None:
    log, commits = tmp_path / "runs" / "r" / "logs" / "actor-0-1.log", []
    code = run_logged(
        [sys.executable, "-c", PRINTS],
        os.environ,
        log,
        commit=lambda: commits.append(log.read_text()),
        commit_every=0.1,
    )
    lines = [f"line {i}" for i in range(4)]
    assert code == 5 and log.read_text().splitlines() == lines
    assert [line for line in capfd.readouterr().out.splitlines() if line.startswith("line")] == lines
    assert len(commits) >= 2, "while it printed, and at the end"
    assert commits[-1] == log.read_text() and len(set(commits)) == len(commits), (
        "only when something new came"
    )


def test_a_failing_commit_costs_only_freshness(tmp_path: Path) -> None:
    def broken() -> None:
        raise OSError("volume busy")

    log = tmp_path / "w.log"
    assert run_logged([sys.executable, "-c", "print('ok')"], os.environ, log, commit=broken) == 0
    assert log.read_text() == "ok\n"


def test_the_log_on_the_volume_is_capped_as_a_local_workers_is(tmp_path: Path) -> None:
    """The cap the worker's environment sets (state/log_rotation.py); the newest output is in the log."""
    script = (
        "import time\nfor i in range(400):\n    print(f'debug line {i:04d}', flush=True)\n"
        "    if i % 100 == 99: time.sleep(0.1)\nprint('last', flush=True)"
    )
    log = tmp_path / "w.log"
    env = {**os.environ, "MORTAL_WORKER_LOG_MAX_BYTES": "2000"}
    assert run_logged([sys.executable, "-c", script], env, log) == 0
    rotated = tmp_path / "w.log.1"
    assert rotated.exists() and 0 < log.stat().st_size <= 2000 + 65536
    assert log.read_text().splitlines()[-1] == "last"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeModal]:
    modal = FakeModal(volume=tmp_path, functions={"worker": "modal_fake:logged"})
    yield modal
    modal.shutdown()


def test_a_cancelled_call_stops_the_worker_and_still_commits_its_last_lines(
    fake: FakeModal, tmp_path: Path
) -> None:
    log, commits = tmp_path / "serving.log", tmp_path / "commits"
    launch = WorkerLaunch(
        run="r",
        role="actor",
        replica=0,
        incarnation=1,
        worker_id="r/actor-0#1",
        state_url="https://store.example",
        mortal_home="/mortal",
        env={"SCRIPT": SERVES, "LOG": str(log), "COMMITS": str(commits), "EVERY": "60"},
    )
    backend = ModalBackend(modal=fake)
    handle = backend.launch(launch)
    wait_for(
        lambda: log.exists() and log.read_text() == "serving\n", 20, "the worker's first line in its log"
    )
    backend.stop(handle, grace_seconds=5)
    assert commits.read_text().splitlines() == [str(len("serving\n"))], (
        "one commit: at the end, after the line"
    )


def test_a_log_the_volume_refuses_starts_no_worker(tmp_path: Path) -> None:
    """The worker would write its checkpoints there too: the call fails at once (a lost worker,
    relaunched)."""
    (tmp_path / "runs").write_text("a file where the runs folder should be")
    ran = tmp_path / "ran"
    with pytest.raises(OSError):
        run_logged(
            [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], os.environ, tmp_path / "runs" / "r" / "w.log"
        )
    assert not ran.exists()
