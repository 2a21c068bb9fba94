"""The rollout worker as a real process (`python -m mortal.workers.main`, the worker protocol's env):
it answers tasks and stops on SIGTERM with 0; a broken reward ends it with exit 3 and the reason
in its worker row, never a hung process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import wait_for
from rollout_helpers import (
    arith_task,
    assets_available,
    create_run,
    make_tiny_model,
    new_worker,
    only_result,
    training_spec,
)

from mortal.state import Store, WorkerRef, open_store
from mortal.workers.data import load_rows

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
HERE = Path(__file__).resolve().parents[1]  # tests/workers: the helpers a worker imports


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def launch(worker: WorkerRef, url: str, home: Path) -> subprocess.Popen:
    """Start a worker process as the local backend does (env of the worker protocol, log to a file)."""
    env = {
        **os.environ,
        "MORTAL_RUN": worker.run,
        "MORTAL_ROLE": worker.role,
        "MORTAL_REPLICA": str(worker.replica),
        "MORTAL_INCARNATION": str(worker.incarnation),
        "MORTAL_HOME": str(home),
        "MORTAL_STATE_URL": url,
        "MORTAL_WORKER_ID": worker.id,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
    }
    log = open(home / f"{worker.role}-{worker.replica}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "mortal.workers.main"], env=env, stdout=log, stderr=log)


def worker_row(store: Store, worker: WorkerRef):
    [row] = [r for r in store.list_workers(worker.run) if r.incarnation == worker.incarnation]
    return row


def watching(proc: subprocess.Popen, home: Path) -> dict:
    """wait_for options for a worker process: give up when it exits, show its logs on failure."""
    return {
        "give_up": lambda: proc.poll() is not None,
        "details": lambda: "worker logs:\n" + "".join(p.read_text() for p in home.glob("*.log"))[-3000:],
    }


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, mortal_home: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{mortal_home / 'state.db'}"
        return
    yield request.getfixturevalue("pg_database")


def test_a_rollout_process_answers_tasks_and_stops_on_sigterm(
    url: str, mortal_home: Path, tiny_dir: Path
) -> None:
    store = open_store(url)
    run = create_run(store, "proc", training_spec(str(tiny_dir)))
    actor = new_worker(store, run, "actor")
    rows = load_rows(run.spec.dataset)[:3]
    store.enqueue_tasks(actor, [arith_task(1, slot, row) for slot, row in enumerate(rows)])
    worker = new_worker(store, run, "rollout")
    proc = launch(worker, url, mortal_home)
    try:
        done = wait_for(
            lambda: all(t.state == "done" for t in store.step_results("proc", 1)) or None,
            120,
            "tasks done",
            **watching(proc, mortal_home),
        )
        assert done
        for task in store.step_results("proc", 1):
            result = only_result(task)
            assert len(result.completion_ids) == 4 and set(result.rewards) == {
                "correct_answer",
                "short_answer",
            }
        # The next heartbeat (about a second) carries the version it generated with: the spec's model, v0.
        wait_for(
            lambda: worker_row(store, worker).weight_version == 0,
            10,
            "a heartbeat with v0",
            **watching(proc, mortal_home),
        )
        assert worker_row(store, worker).state == "Running"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        store.close()


@pytest.mark.parametrize(
    ("function", "reason", "message"),
    [
        ("reward_fixtures:missing", "RewardNotFound", "module reward_fixtures has no attribute missing"),
        ("no_such_module_xyz:score", "RewardNotFound", "cannot import module 'no_such_module_xyz'"),
        ("reward_fixtures:raises", "RewardFailed", "raised ValueError: boom: cannot score this"),
    ],
)
def test_a_broken_reward_ends_the_worker_with_exit_3_and_the_reason(
    mortal_home: Path, tiny_dir: Path, function: str, reason: str, message: str
) -> None:
    url = f"sqlite:///{mortal_home / 'state.db'}"
    store = open_store(url)
    run = create_run(store, "bad", training_spec(str(tiny_dir), rewards=[{"function": function}]))
    store.enqueue_tasks(new_worker(store, run, "actor"), [arith_task(1, 0, load_rows(run.spec.dataset)[0])])
    worker = new_worker(store, run, "rollout")
    proc = launch(worker, url, mortal_home)
    try:
        assert proc.wait(timeout=120) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
    row = worker_row(store, worker)
    assert (row.state, row.exit_code) == ("Failed", 3)
    assert row.message.startswith(f"{reason}: ") and message in row.message
    assert f"spec.rewards[0].function '{function}'" in row.message
    store.close()
