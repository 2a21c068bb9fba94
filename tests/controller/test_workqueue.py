"""The work queue: one entry per key, no concurrent processing of a key, timers, capped backoff."""

from __future__ import annotations

import threading
import time

import pytest

from mortal.controller.outcome import Done, RequeueAfter, Retry, Terminal
from mortal.controller.workqueue import WorkQueue, dispatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_key_is_queued_once():
    q = WorkQueue()
    for key in ("a", "b", "a", "a"):
        q.add(key)
    assert [q.get(0), q.get(0), q.get(0)] == ["a", "b", None]


def test_a_key_added_while_processing_runs_again_after_done_never_concurrently():
    q = WorkQueue()
    q.add("a")
    assert q.get(0) == "a"
    q.add("a")  # a change arrives during the pass
    assert q.get(0) is None  # not handed to a second worker
    q.done("a")
    assert q.get(0) == "a"


def test_add_after_fires_at_its_time_and_the_earliest_timer_wins():
    clock = Clock()
    q = WorkQueue(clock=clock)
    q.add_after("a", 5)
    q.add_after("a", 2)
    q.add_after("a", 9)
    assert q.get(0) is None
    clock.now += 2
    assert q.get(0) == "a"
    q.done("a")
    clock.now += 10
    assert q.get(0) is None  # the superseded timers do not fire again
    assert q.pending_timers() == 0


def test_backoff_doubles_per_failure_is_capped_and_resets_on_forget():
    q = WorkQueue(base_delay=0.5, max_delay=4.0, clock=Clock())
    assert [q.add_rate_limited("a") for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert q.add_rate_limited("b") == 0.5  # per key
    q.forget("a")
    assert q.add_rate_limited("a") == 0.5


@pytest.mark.parametrize(
    ("outcome", "queued_at", "failures"),
    [(Done(), None, 0), (RequeueAfter(3.0), 3.0, 0), (Retry("x"), 0.5, 1), (Terminal("x"), None, 0)],
)
def test_dispatch_interprets_each_outcome(outcome, queued_at, failures):
    clock = Clock()
    q = WorkQueue(base_delay=0.5, clock=clock)
    q.add("a")
    assert q.get(0) == "a"
    dispatch(q, "a", outcome)
    q.done("a")
    assert q.failures("a") == failures
    if queued_at is None:
        clock.now += 1000
        assert q.get(0) is None
    else:
        clock.now += queued_at - 0.01
        assert q.get(0) is None
        clock.now += 0.02
        assert q.get(0) == "a"


def test_success_resets_the_backoff():
    q = WorkQueue(clock=Clock())
    q.add_rate_limited("a")
    dispatch(q, "a", Done())
    assert q.failures("a") == 0


def test_get_blocks_until_a_timer_is_due_and_shutdown_releases_waiters():
    q = WorkQueue()
    q.add_after("a", 0.2)
    started = time.monotonic()
    assert q.get(timeout=5) == "a"
    assert 0.15 < time.monotonic() - started < 2
    got = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    q.shutdown()
    waiter.join(2)
    assert got == [None]


def test_many_threads_never_process_one_key_twice_at_once():
    q = WorkQueue()
    active, overlaps, processed = set(), [], []
    lock = threading.Lock()

    def worker():
        while (key := q.get(timeout=0.5)) is not None:
            with lock:
                if key in active:
                    overlaps.append(key)
                active.add(key)
            time.sleep(0.001)
            with lock:
                active.discard(key)
                processed.append(key)
            q.done(key)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(400):
        q.add(f"k{i % 5}")
    for t in threads:
        t.join(10)
    assert overlaps == []
    assert set(processed) == {f"k{i}" for i in range(5)}


def test_urgent_changes_go_before_timers_and_resyncs():
    q = WorkQueue()
    for key in ("r1", "r2", "r3"):
        q.add(key)
    q.add("r3", urgent=True)  # promoted: served first, and only once
    q.add("x", urgent=True)
    got = [q.get(0) for _ in range(5)]
    assert got == ["r3", "x", "r1", "r2", None]


def test_an_urgent_add_during_processing_is_urgent_when_requeued():
    q = WorkQueue()
    q.add("a")
    assert q.get(0) == "a"
    q.add("b")
    q.add("a", urgent=True)
    q.done("a")
    assert [q.get(0), q.get(0)] == ["a", "b"]
