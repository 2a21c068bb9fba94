"""A controller killed at any line of the launch protocol, then restarted: no twin, no orphan.

The crash is injected with a failpoint (MORTAL_FAILPOINT): the controller SIGKILLs itself right after
recording the intent row (nothing launched), or right after the launch (handle never recorded).
On SQLite only: what is checked is the controller's launch protocol and re-adoption (tests/store_kinds.py).
"""

from __future__ import annotations

import os
import signal

import pytest
from realproc import harness, wait_for, worker_ids, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import sqlite_only

from mortal.workers.simulated import simulated_run

NAME = "crashy-controller"
pytestmark = sqlite_only


def one_process_per_live_row(h) -> bool:
    uid = h.store.get_run(NAME).uid  # a worker's process marker carries its run's uid (WorkerRef.process_id)
    rows = sorted(f"{w.run}/{w.role}-{w.replica}#{w.incarnation}@{uid}" for w in h.live_rows(NAME))
    return rows == worker_ids(h.home) and len(rows) == 2


@pytest.mark.parametrize("failpoint", ["launch:after-intent", "launch:after-launch"])
def test_restart_after_a_crash_inside_the_launch_protocol(harness, failpoint):  # noqa: F811
    h = harness
    h.apply(simulated_run(NAME, max_steps=12, rollout_replicas=1, step_seconds=0.1))
    crashing = h.spawn(env={"MORTAL_FAILPOINT": failpoint})
    assert crashing.wait(timeout=60) == -signal.SIGKILL
    [intent] = h.store.list_workers(NAME)
    assert intent.state == "Pending" and intent.handle is None
    launched = failpoint == "launch:after-launch"
    assert len(worker_processes(h.home)) == (1 if launched else 0)

    h.start()  # a fresh controller: waits out the dead one's lease, then converges
    wait_for(lambda: one_process_per_live_row(h), 30, "exactly one process per live worker row")
    first = h.store.list_workers(NAME)[0]
    if launched:  # the process was adopted: same row, its handle now recorded
        assert (first.id, first.state) == (intent.id, "Running") and first.handle is not None
    else:  # nothing ran: the intent was closed and the slot launched again, not counted as a restart
        assert first.state == "Stopped"
    final = h.wait_phase(NAME, "Succeeded", timeout=60)
    assert final["restarts"] == 0 and final["step"] == 12
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


def test_kill_9_of_the_controller_mid_run_readopts_its_workers(harness):  # noqa: F811
    h = harness
    h.apply(simulated_run(NAME, max_steps=60, rollout_replicas=2, step_seconds=0.1))
    first = h.spawn()
    wait_for(lambda: (h.status(NAME).get("step") or 0) >= 3, 30, "training under the first controller")
    before = {p.pid for p in worker_processes(h.home)}
    rows_before = len(h.store.list_workers(NAME))
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

    h.start()
    step = h.status(NAME)["step"]
    wait_for(lambda: (h.status(NAME).get("step") or 0) > step + 3, 30, "training under the new controller")
    assert {p.pid for p in worker_processes(h.home)} == before, "workers were relaunched, not adopted"
    assert len(h.store.list_workers(NAME)) == rows_before
    h.wait_phase(NAME, "Succeeded", timeout=60)
    assert h.status(NAME)["restarts"] == 0
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")
