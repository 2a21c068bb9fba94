"""One backend listing shared by every run's reconcile for a fraction of a second.

Who calls it: the reconciler, instead of `backend.list(run)` per pass. A local listing scans the whole
process table; with many runs, one scan per pass would be most of the work. Sharing is safe for the
planner: a listing is always taken before the pass reads its worker rows (so an exit it shows was
reported first), and a process launched after the listing is covered by the launch grace. The
reconciler invalidates the listing after it launched or stopped something.
What it must not do: keep a listing longer than `max_age`, or decide anything from it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mortal.controller.backends.base import Backend, BackendWorker


class SharedListing:
    def __init__(self, backend: Backend, max_age: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.backend, self.max_age, self._clock = backend, max_age, clock
        self._lock = threading.Lock()
        self._workers: list[BackendWorker] = []
        self._taken = float("-inf")
        self.scans = 0

    def list(self, run: str) -> list[BackendWorker]:
        """The workers of `run` from a listing at most `max_age` old (one scan at a time)."""
        with self._lock:
            if self._clock() - self._taken >= self.max_age:
                taken = self._clock()
                self._workers = self.backend.list()
                self._taken = taken
                self.scans += 1
            return [w for w in self._workers if w.run == run]

    def invalidate(self) -> None:
        with self._lock:
            self._taken = float("-inf")
