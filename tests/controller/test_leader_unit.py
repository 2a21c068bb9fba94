"""LeaderElector against a real store: acquire, renew keeps the token, expiry by its own clock, release."""

from __future__ import annotations

import threading
from datetime import timedelta

from store_kinds import caller_clock

from mortal.controller.leader import LEASE_NAME, LeaderElector
from mortal.state.tables import utcnow


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_first_holder_leads_second_waits(store):
    started = []
    a = LeaderElector(store, holder="a", on_started_leading=lambda: started.append("a"))
    b = LeaderElector(store, holder="b")
    assert a.try_acquire() and not b.try_acquire()
    assert a.fence().token == 1 and b.fence() is None
    assert a.try_acquire() and a.fence().token == 1  # a renewal keeps the token
    assert started == ["a"]  # called once, on becoming leader


def test_local_validity_ends_before_the_store_lease(store):
    clock = Clock()
    a = LeaderElector(store, holder="a", duration_seconds=5, clock=clock)
    assert a.try_acquire()
    clock.now = 3.9
    assert a.is_leader
    clock.now = 4.1  # 80% of the lease passed without a renewal: stop writing before the store would refuse
    assert not a.is_leader


@caller_clock
def test_takeover_after_expiry_gets_a_new_token_and_the_old_leader_learns_it(store):
    a = LeaderElector(store, holder="a", duration_seconds=5)
    assert a.try_acquire()
    later = utcnow() + timedelta(seconds=6)  # b arrives after a's lease ran out
    assert store.acquire_lease(LEASE_NAME, "b", 5, now=later).token == 2
    assert not a.try_acquire()  # a's next renewal finds b holding it
    assert a.fence() is None


def test_lost_drops_leadership_at_once(store):
    a = LeaderElector(store, holder="a")
    assert a.try_acquire()
    a.lost()
    assert not a.is_leader


def test_run_releases_the_lease_on_stop_so_the_next_takes_over_at_once(store):
    a = LeaderElector(store, holder="a", renew_seconds=0.05)
    stop = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop,))
    thread.start()
    while not a.is_leader:
        stop.wait(0.01)
    stop.set()
    thread.join(5)
    b = LeaderElector(store, holder="b")
    assert b.try_acquire() and b.fence().token == 2
