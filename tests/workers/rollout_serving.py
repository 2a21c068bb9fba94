"""A RolloutWorker's loop served in a thread of the test, and a wait for a step's tasks to be done.

Imported by tests/workers/rollout/test_rollout.py and rewards/test_environments_spec.py: a module of its
own, on the path every test under tests/workers/ has, so that either runs alone.
"""

from __future__ import annotations

import threading
import time

from rollout_helpers import new_worker

from mortal.state import Store
from mortal.workers.rollout import loop as rollout
from mortal.workers.runtime import WorkerContext


class Serving:
    """A RolloutWorker's loop in a thread, stopped (and its error raised) on exit."""

    def __init__(self, store: Store, run) -> None:
        self.ctx = WorkerContext(store, new_worker(store, run, "rollout"), run, heartbeat_seconds=0.5)
        self.ctx.check_fence()
        self.worker = rollout.build(self.ctx)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Serving:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.ctx.stopping.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()
        if self.error is not None and exc[0] is None:
            raise self.error


def wait_done(store: Store, run: str, step: int, count: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.step_results(run, step)
        if len(rows) == count and all(r.state == "done" for r in rows):
            return rows
        time.sleep(0.05)
    raise AssertionError(
        f"step {step}: tasks not done in {timeout} s: {[r.state for r in store.step_results(run, step)]}"
    )
