"""The work queue: one entry per run, never two reconciles of one run at once, timers and backoff.

Modelled on client-go's rate-limited delaying queue (what controller-runtime uses). Who calls it: the
manager's watchers `add` runs that changed; worker threads `get` a run, reconcile it, hand the
outcome to `dispatch` (the one place outcomes are interpreted) and call `done`. A run added while it
is being reconciled is marked dirty and queued again when that pass ends, so no change is lost and
no run is reconciled twice concurrently. What it must not do: know what a run is, or sleep for a
caller (timers live here; reconcile never sleeps).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from mortal.controller.outcome import Done, Outcome, RequeueAfter, Retry, Terminal

log = logging.getLogger("mortal.controller")


class WorkQueue:
    """A set-like FIFO of keys with delayed adds and per-key exponential backoff."""

    def __init__(
        self, base_delay: float = 0.5, max_delay: float = 60.0, clock: Callable[[], float] = time.monotonic
    ):
        self.base_delay, self.max_delay, self._clock = base_delay, max_delay, clock
        self._cond = threading.Condition()
        self._urgent: deque[str] = deque()  # changes someone made: served before timers and resyncs
        self._normal: deque[str] = deque()
        self._queued: dict[str, bool] = {}  # key -> queued as urgent
        self._processing: set[str] = set()
        self._dirty: dict[str, bool] = {}
        self._due: dict[str, float] = {}  # key -> the earliest pending timer
        self._timers: list[tuple[float, str]] = []
        self._failures: dict[str, int] = {}
        self._closed = False

    def add(self, key: str, urgent: bool = False) -> None:
        """Queue `key` now (once: a queued key is not queued twice; a key in progress is re-run after).

        `urgent` for a change someone made (spec, wake): it goes before the timers and resyncs, so a
        controller busy resyncing many runs still acts on a `scale` at once (controller-runtime's
        priority queue does the same).
        """
        with self._cond:
            self._add_locked(key, urgent)

    def _add_locked(self, key: str, urgent: bool = False) -> None:
        if self._closed:
            return
        if key in self._processing:
            self._dirty[key] = self._dirty.get(key, False) or urgent
        elif key not in self._queued or (urgent and not self._queued[key]):
            self._queued[key] = urgent  # a promoted key's older normal entry is skipped when reached
            (self._urgent if urgent else self._normal).append(key)
            self._cond.notify()

    def add_after(self, key: str, delay: float) -> None:
        """Queue `key` once `delay` seconds have passed (an earlier pending timer of the key wins)."""
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            due = self._clock() + delay
            if self._due.get(key, float("inf")) <= due:
                return
            self._due[key] = due
            heapq.heappush(self._timers, (due, key))
            self._cond.notify()

    def add_rate_limited(self, key: str) -> float:
        """Queue after this key's backoff (base * 2^failures, capped); returns the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self.max_delay, self.base_delay * 2**failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: str) -> None:
        """The key succeeded: its next failure starts the backoff from the base again."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: str) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def get(self, timeout: float | None = None) -> str | None:
        """The next key to process (now owned by the caller until `done`); None on timeout or shutdown."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                self._fire_timers()
                key = self._pop()
                if key is not None:
                    self._processing.add(key)
                    return key
                if self._closed:
                    return None
                waits = [t for t in (self._timers[0][0] if self._timers else None, deadline) if t is not None]
                if deadline is not None and self._clock() >= deadline:
                    return None
                self._cond.wait(None if not waits else max(0.0, min(waits) - self._clock()))

    def _pop(self) -> str | None:
        for lane, urgent in ((self._urgent, True), (self._normal, False)):
            while lane:
                key = lane.popleft()
                if self._queued.get(key) is urgent:
                    del self._queued[key]
                    return key
        return None

    def _fire_timers(self) -> None:
        now = self._clock()
        while self._timers and self._timers[0][0] <= now:
            due, key = heapq.heappop(self._timers)
            if self._due.get(key) == due:
                del self._due[key]
                self._add_locked(key)

    def done(self, key: str) -> None:
        """Processing of `key` ended; if it was added meanwhile, queue it again."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._add_locked(key, self._dirty.pop(key))

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._queued)

    def pending_timers(self) -> int:
        with self._cond:
            return len(self._due)


def dispatch(queue: WorkQueue, key: str, outcome: Outcome) -> None:
    """The one interpreter of reconcile outcomes (controller-runtime's reconcileHandler)."""
    if isinstance(outcome, Done):
        queue.forget(key)
    elif isinstance(outcome, RequeueAfter):
        queue.forget(key)
        queue.add_after(key, outcome.seconds)
    elif isinstance(outcome, Retry):
        delay = queue.add_rate_limited(key)
        log.warning("reconcile %s failed (retry in %.1fs): %s", key, delay, outcome.error)
    elif isinstance(outcome, Terminal):
        queue.forget(key)
        log.error("reconcile %s failed for good (not retried until the run changes): %s", key, outcome.error)
    else:
        raise TypeError(f"not an Outcome: {outcome!r}")
