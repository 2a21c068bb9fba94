"""Doorbells: a process of a run tells the others on the same machine that the store changed, so a waiting
worker looks at once instead of at its next poll.

A rollout rings RESULTS when it completed a task (the actor's RolloutFeed.collect waits on it); the actor
rings TASKS when it enqueues tasks or records weights (an idle rollout waits on it). A ring touches
<run_dir>/doorbells/<name>; a listener holds an inotify watch on that folder from before its first look at
the store. Why: a GPU step is short, and each side's poll added half an interval to every hand-over, twice
a step (docs/benchmarks.md). Why inotify_simple and not watchfiles: an inotify descriptor is waited on in
the kernel, where watchfiles' loop wakes periodically to take the GIL beside a host-bound training step.
What it must not do: carry data or replace the poll. The store is the only truth: a ring not heard costs
one poll interval, never a result. Only the local backend's workers ring (DOORBELLS_ENV).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("mortal.worker")

RESULTS = "results"  # a rollout completed a task
TASKS = "tasks"  # the actor enqueued tasks or recorded a weight version
# "1": this worker's run has its processes on this machine: set by the local backend
# (controller/backends/base.py names it too: the layers share the worker protocol's variable names, not a
# module)
DOORBELLS_ENV = "MORTAL_DOORBELLS"
FOLDER = "doorbells"


class Doorbell:
    """Rings any name; hears `listens_for` (None: rings only). With `run_dir` None, a silent one: it rings
    nothing and its wait is the poll interval (a worker whose run is spread over machines), so that the
    waiters have one code path whether or not their backend rings."""

    def __init__(self, run_dir: Path | None, listens_for: str | None = None) -> None:
        self.folder = None if run_dir is None else run_dir / FOLDER
        self.listens_for = listens_for
        self._inotify: Any = self._listen() if listens_for and self.folder is not None else None

    @classmethod
    def for_worker(cls, run_dir: Path, listens_for: str | None = None) -> Doorbell:
        """The worker's doorbell where its backend put the run's processes on one machine, else a silent
        one."""
        return cls(run_dir if os.environ.get(DOORBELLS_ENV) == "1" else None, listens_for)

    @property
    def hears(self) -> bool:
        return self._inotify is not None

    def _listen(self) -> Any:
        try:
            from inotify_simple import INotify, flags

            self.folder.mkdir(parents=True, exist_ok=True)
            inotify = INotify()
            inotify.add_watch(self.folder, flags.ATTRIB | flags.CLOSE_WRITE)
            return inotify
        except (ImportError, OSError, AttributeError) as exc:  # no inotify here (not Linux, no watches left)
            log.info("doorbells are not heard here (%s): waits last their whole poll interval", exc)
            return None

    def ring(self, name: str) -> None:
        """Wake the listeners of `name`. Best effort: a ring that fails only leaves them to their poll."""
        if self.folder is None:
            return
        path = self.folder / name
        try:
            path.touch()
        except FileNotFoundError:  # no listener has made the folder yet
            with contextlib.suppress(OSError):
                self.folder.mkdir(parents=True, exist_ok=True)
                path.touch()
        except OSError:
            pass

    def wait(self, timeout: float, stopping: threading.Event | None = None) -> bool:
        """Until `listens_for` rings or `timeout` seconds pass, or at once when `stopping` is set (without
        inotify, setting it ends the wait too); whether it rang (a ring since the last wait counts: inotify
        keeps it)."""
        if stopping is not None and stopping.is_set():
            return False
        if self._inotify is None:
            if stopping is not None:
                stopping.wait(timeout)
            else:
                time.sleep(timeout)
            return False
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            events = self._inotify.read(timeout=max(1, math.ceil(left * 1000)))
            if any(event.name == self.listens_for for event in events):
                return True
        return False

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
