"""Leader election through a lease in the store: one controller reconciles, the others wait.

Who calls it: the manager runs `LeaderElector.run` in a thread; the reconciler asks `fence()` before
every pass and carries the returned `LeaderFence` on each of its writes, so the store refuses the
writes of a leader whose lease moved on (a SIGSTOPped leader that wakes up late). A leader also
stops on its own: once its last successful renewal is older than the lease (by its monotonic clock),
`fence()` returns None even before the store says so. What it must not do: reconcile anything.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from mortal.state.store import LeaderFence, Store

log = logging.getLogger("mortal.controller")
LEASE_NAME = "controller"


def new_holder() -> str:
    """host:pid:random, unique per controller process (a restarted one is a new holder)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def holder_gone_here(holder: str) -> bool:
    """Whether `holder` (new_holder's host:pid:random) names a process of this host that no longer runs: its
    lease, unexpired for a few seconds more, then stands for no controller (one killed with SIGKILL)."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


class LeaderElector:
    """Acquire and renew the `controller` lease; know at every moment whether we may still write."""

    def __init__(
        self,
        store: Store,
        holder: str | None = None,
        duration_seconds: float = 5.0,
        renew_seconds: float = 1.0,
        on_started_leading: Callable[[], None] | None = None,
        name: str = LEASE_NAME,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.name = store, name
        self.holder = holder or new_holder()
        self.duration, self.renew = duration_seconds, renew_seconds
        self.on_started_leading = on_started_leading
        self._clock = clock
        self._lock = threading.Lock()
        self._fence: LeaderFence | None = None
        self._valid_until = 0.0

    def fence(self) -> LeaderFence | None:
        """The fence to write with, or None if we are not (or may no longer be) the leader."""
        with self._lock:
            if self._fence is not None and self._clock() < self._valid_until:
                return self._fence
            return None

    @property
    def is_leader(self) -> bool:
        return self.fence() is not None

    def try_acquire(self) -> bool:
        """One acquire-or-renew round; True while we lead. The validity clock starts before the call,
        so local validity always ends before the store's expiry."""
        started = self._clock()
        try:
            lease = self.store.acquire_lease(self.name, self.holder, self.duration)
        except Exception as exc:  # the store is unreachable: keep what validity we have, no more
            log.warning("lease renewal failed: %s", exc)
            return self.is_leader
        with self._lock:
            was = self._fence
            if lease is None:
                self._fence = None
            else:
                self._fence = LeaderFence(self.name, self.holder, lease.token)
                self._valid_until = started + self.duration * 0.8
            now_leading = self._fence is not None and (was is None or was.token != self._fence.token)
        if now_leading and lease is not None:
            log.info("leading as %s (token %d)", self.holder, lease.token)
            if self.on_started_leading is not None:
                self.on_started_leading()
        elif was is not None and self._fence is None:
            log.warning("lost the leader lease to another controller")
        return self._fence is not None

    def lost(self) -> None:
        """The store refused a write as Fenced: stop acting as leader at once."""
        with self._lock:
            if self._fence is not None:
                log.warning("fenced by the store: no longer the leader")
            self._fence = None

    def run(self, stop: threading.Event) -> None:
        """Renew every `renew` seconds until `stop`; then give the lease up for the next controller."""
        while not stop.is_set():
            self.try_acquire()
            stop.wait(self.renew)
        self.release()

    def release(self) -> None:
        with self._lock:
            held, self._fence = self._fence is not None, None
        if held:
            try:
                self.store.release_lease(self.name, self.holder)
            except Exception as exc:  # best effort: the lease expires by itself
                log.warning("could not release the lease: %s", exc)
