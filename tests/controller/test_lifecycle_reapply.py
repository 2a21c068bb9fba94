"""A name is reusable at once: a run deleted and applied again at once is a new run (a new uid) that
starts fresh and trains, while the old run's workers may still be shutting down; their exits and fences
are never counted against the new run, and the old run's files are not the new run's.
On SQLite only: the subject is the controller and the local backend (tests/store_kinds.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from realproc import harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.controller import wake
from mortal.state import paths
from mortal.state.store import WorkerRef
from mortal.workers.simulated import simulated_run

pytestmark = sqlite_only
NAME = "again"


def spec():
    return simulated_run(NAME, max_steps=100_000, rollout_replicas=2, step_seconds=0.1)


def straggler(
    h, uid: str, role: str, replica: int, incarnation: int, marked: bool
) -> subprocess.Popen[bytes]:
    """A worker process of the deleted run still shutting down (it writes nothing: it carries the old run's
    identity, as a worker busy in its SIGTERM handler does). `marked`: its process marker carries the uid,
    as the controller launches workers now; else the bare id, as an older controller launched them."""
    ref = WorkerRef(NAME, role, replica, incarnation, run_uid=uid)
    marker = ref.process_id if marked else ref.id
    env = {
        **os.environ,
        "MORTAL_RUN": NAME,
        "MORTAL_ROLE": role,
        "MORTAL_REPLICA": str(replica),
        "MORTAL_INCARNATION": str(incarnation),
        "MORTAL_WORKER_ID": marker,
        "MORTAL_RUN_UID": uid,
        "MORTAL_HOME": str(h.home),
        "MORTAL_STATE_URL": h.url,
    }
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True
    )


def test_delete_then_apply_at_once_trains_a_new_run_four_times_in_a_row(harness):  # noqa: F811
    h = harness
    row = h.apply(spec())
    h.start()
    uids = [row.uid]
    for attempt in range(5):
        wait_for(
            lambda: (
                (s := h.status(NAME)).get("phase") == "Failed"
                or (s.get("step") or 0) >= 3
                and s["replicas"]["rollout"]["ready"] == 2
            ),
            30,
            f"run {attempt + 1} to train",
        )
        status = h.status(NAME)
        assert status["phase"] == "Running", (attempt, status.get("message"))
        assert status["restarts"] == 0, (attempt, [e.message for e in h.store.list_events(NAME, limit=100)])
        if attempt == 4:
            break
        # an exit the backend still remembers: the old run's first rollout-1, killed and relaunched
        first = next(w for w in h.live_rows(NAME, "rollout") if w.replica == 1)
        os.killpg(int(first.handle.split(":")[0]), signal.SIGKILL)
        wait_for(
            lambda f=first: any(
                w.replica == 1 and w.incarnation > f.incarnation for w in h.live_rows(NAME, "rollout")
            ),
            20,
            "rollout-1 relaunched",
        )
        old_uid = row.uid
        h.store.mark_deleted(NAME)
        wake.notify(NAME)
        wait_for(lambda: NAME not in {r.name for r in h.store.list_runs()}, 30, f"run {attempt + 1} purged")
        stray = straggler(
            h, old_uid, "rollout", 0, 2, marked=attempt % 2 == 0
        )  # the incarnation the new run's rollout-0 will get
        row = h.apply(spec())
        uids.append(row.uid)
        wait_for(lambda s=stray: s.poll() is not None, 30, "the old run's straggler to be stopped")
    assert len(set(uids)) == 5, "each apply after a delete must be a new run"
    log = paths.worker_log(NAME, "actor", 0, 1).read_text()
    assert log.count("starting (pid") == 1, "the new run's log holds an earlier run's lines"
    for uid in uids[:-1]:  # each deleted run's files are kept under its uid, none was swept by its successor
        assert any((paths.kept_run_dir(NAME, uid) / "checkpoints").iterdir()), uid
    h.store.mark_deleted(NAME)
    wake.notify(NAME)
    wait_for(lambda: NAME not in {r.name for r in h.store.list_runs()}, 30, "the last run purged")
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")
