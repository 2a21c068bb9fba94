"""One leader: two controllers elect one through the store's lease; the other takes over when the
leader is SIGSTOPped or killed past its lease; a leader that lost its lease cannot write."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

from realproc import FAST, harness, wait_for, worker_processes  # noqa: F401 - harness is a fixture
from store_kinds import caller_clock, sql_stores

from mortal.controller.leader import LEASE_NAME, LeaderElector
from mortal.controller.outcome import Done
from mortal.controller.reconciler import Reconciler
from mortal.state.tables import utcnow
from mortal.workers.simulated import simulated_run

NAME = "leader"


def holder_pid(h) -> int | None:
    lease = h.store.get_lease(LEASE_NAME)
    if lease is None or lease.expires_at.replace(tzinfo=None) < utcnow().replace(tzinfo=None):
        return None
    return int(lease.holder.split(":")[1])


@sql_stores  # a leader frozen inside a transaction holds SQLite's write lock or a PostgreSQL session
def test_two_controllers_one_leader_takeover_after_sigstop_and_kill(harness):  # noqa: F811
    h = harness
    h.apply(simulated_run(NAME, max_steps=100_000, rollout_replicas=1, step_seconds=0.1))
    a, b = h.spawn(log="controller-a"), h.spawn(log="controller-b")
    leader_pid = wait_for(lambda: holder_pid(h), 30, "a leader")
    wait_for(lambda: (h.status(NAME).get("step") or 0) >= 3, 30, "training")
    leader, standby = (a, b) if leader_pid == a.pid else (b, a)
    token = h.store.get_lease(LEASE_NAME).token
    workers = {p.pid for p in worker_processes(h.home)}

    os.kill(leader.pid, signal.SIGSTOP)  # frozen past its 5 s lease
    stopped_at = time.monotonic()
    wait_for(lambda: holder_pid(h) == standby.pid, 15, "the standby to take over")
    assert time.monotonic() - stopped_at < 10
    assert h.store.get_lease(LEASE_NAME).token == token + 1
    step = h.status(NAME)["step"]
    wait_for(lambda: h.status(NAME)["step"] > step + 3, 20, "training under the new leader")
    assert {p.pid for p in worker_processes(h.home)} == workers, "a takeover relaunched workers"

    os.kill(leader.pid, signal.SIGCONT)  # the old leader wakes up: it must not act as leader
    time.sleep(3)
    assert holder_pid(h) == standby.pid
    assert {p.pid for p in worker_processes(h.home)} == workers

    os.killpg(standby.pid, signal.SIGKILL)
    wait_for(lambda: holder_pid(h) == leader.pid, 15, "the first controller to lead again")
    step = h.status(NAME)["step"]
    wait_for(lambda: h.status(NAME)["step"] > step + 3, 20, "training under the first controller again")

    h.store.mark_deleted(NAME)
    wait_for(lambda: not h.store.list_runs(), 30, "the run to be purged")
    wait_for(lambda: not worker_processes(h.home), 20, "every worker to exit")


@caller_clock  # the takeover is dated ahead with `now`; over HTTP the server's clock decides leases
def test_a_leader_whose_lease_moved_on_is_fenced(harness):  # noqa: F811
    """Its clock says it still leads (it was paused), the store says otherwise: no write lands."""
    h = harness
    h.apply(simulated_run(NAME, max_steps=5))
    frozen = [0.0]
    elector = LeaderElector(h.store, holder="old:1:x", duration_seconds=5, clock=lambda: frozen[0])
    assert elector.try_acquire()
    before = h.store.get_run(NAME)
    takeover = h.store.acquire_lease(LEASE_NAME, "new:2:y", 5, now=utcnow() + timedelta(seconds=6))
    assert takeover is not None and takeover.token == 2
    assert elector.fence() is not None  # still believes it leads

    outcome = Reconciler(h.store, h.url, elector, FAST).reconcile(NAME)
    assert outcome == Done()  # the run is the new leader's now
    assert elector.fence() is None
    assert h.store.list_workers(NAME) == []
    assert h.store.get_run(NAME).resource_version == before.resource_version
    assert worker_processes(h.home) == []


@sql_stores
def test_the_standby_that_leads_once_the_controller_stops_is_the_one_controller_stop_finds(
    harness,  # noqa: F811
    monkeypatch,
):
    """`controller stop` stops this home's controller (its pid file); a second one started beside it stood
    by, leads once it stops, and takes the pid file: status and the next stop find it, not "none runs"."""
    from mortal.controller.manager import running_controller_pid, stop_controller

    h = harness
    monkeypatch.setenv("MORTAL_HOME", str(h.home))
    first = h.spawn(log="controller-a")
    wait_for(lambda: holder_pid(h) == first.pid and running_controller_pid() == first.pid, 30, "a to lead")
    second = h.spawn(log="controller-b")
    wait_for(lambda: "stands by" in (h.home / "controller-b.log").read_text(), 30, "b to stand by")
    assert stop_controller(20) == (first.pid, False)
    wait_for(lambda: holder_pid(h) == second.pid, 20, "b to lead")
    wait_for(lambda: running_controller_pid() == second.pid, 10, "b to take the pid file")
    assert stop_controller(20) == (second.pid, False)
    assert running_controller_pid() is None
