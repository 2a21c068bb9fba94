"""The worker runtime: what every worker process has around its workload (protocol in COMMON.md).

Who calls it: mortal.workers.main builds a `WorkerContext` from the environment a backend set
(MORTAL_RUN, MORTAL_ROLE, MORTAL_REPLICA, MORTAL_INCARNATION, MORTAL_STATE_URL, ...), starts it and
hands it to the workload's `main(ctx)`. Workloads read `ctx.run`, write through `ctx.store`, tell
the heartbeat their progress with `ctx.report(...)` and what they are doing with `with ctx.activity(...)`
(a task, a step, a weight load: the controller relaunches a worker stuck in one past its deadline, after
asking it for its stacks: SIGUSR1 where its backend can signal the process, and on every backend through
the store, which the heartbeat thread answers; mortal.workers.deadline), and watch `ctx.stopping`.
What it must not do: let a zombie write. Any store call that raises Fenced (a newer incarnation
owns the slot, or the slot was ended) ends the process at once with EXIT_FENCED, from whichever
thread saw it.

Exit codes: 0 succeeded (or stopped on request: then no report is written), 3 fatal (the run cannot
succeed), 75 retryable (crash: relaunch with backoff), 76 fenced (a zombie; nothing to do).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from mortal.specs import TrainingRun, memory
from mortal.specs.errors import SpecError
from mortal.state import paths
from mortal.state.errors import Fenced
from mortal.state.store import Store, WorkerRef
from mortal.state.tables import WorkerRow
from mortal.workers.deadline import dump_stacks, register_stack_dump
from mortal.workers.errors import FatalWorkerError

EXIT_SUCCEEDED = 0
EXIT_FATAL = 3
EXIT_OUT_OF_MEMORY = 4  # out of GPU memory (mortal.workers.oom): relaunched at most once
EXIT_RETRYABLE = 75
EXIT_FENCED = 76

DEFAULT_HEARTBEAT_SECONDS = 1.0
log = logging.getLogger("mortal.worker")


def exit_fenced(exc: BaseException) -> NoReturn:
    """A newer incarnation owns this slot: say so and leave without another write (no cleanup)."""
    log.error("fenced, exiting at once without another write: %s", exc)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FENCED)


class FencingStore:
    """The store, as a workload sees it: every method that raises Fenced ends the process instead."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @property
    def inner(self) -> Store:
        return self._store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Fenced as exc:
                exit_fenced(exc)

        setattr(self, name, guarded)
        return guarded


def cpu_threads(role: str, run: TrainingRun, cores: int | None = None) -> int | None:
    """How many CPU threads a worker of a CPU run should use; None for a worker on a GPU.

    The run's processes share the machine's cores. On-policy they take turns (rollouts generate
    while the actor waits, then the actor trains while rollouts wait for its weights), so the
    actor gets every core and the rollout replicas split them. Without this, three processes of
    two threads each on two cores run several times slower than one. Depends on the spec only,
    so a relaunched actor uses the same count: same float sums, bit-exact resume.
    """
    spec = run.spec
    if (spec.actor.gpu if role == "actor" else spec.rollout.gpu) != "none":
        return None
    cores = cores or os.cpu_count() or 1
    return cores if role == "actor" else max(1, cores // max(1, spec.rollout.replicas))


def pin_cpu_threads(role: str, run: TrainingRun) -> None:
    """Set MORTAL_THREADS / OMP_NUM_THREADS before torch is imported (an explicit setting wins)."""
    threads = os.environ.get("MORTAL_THREADS") or cpu_threads(role, run)
    if threads is not None:
        os.environ.setdefault("MORTAL_THREADS", str(threads))
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@contextlib.contextmanager
def startup_objects_frozen() -> Any:
    """Around a worker's loop: every object alive as it starts (imports, the model, the trainer) is left
    out of the garbage collector's full collections, and put back after.

    Why: a worker starts with hundreds of thousands of tracked objects (torch, transformers, TRL), alive for
    the whole process, and CPython's full collections walk every one of them, in the middle of a step; with
    them frozen (gc.freeze) such a collection is orders of magnitude shorter (docs/benchmarks.md).
    Start-up's garbage is collected first, so that it is not frozen with them."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class CollectionClock:
    """The seconds the garbage collector spent collecting (every generation), taken step by step: a
    step's time that none of its timers explains may be a collection in the middle of it (a metric,
    actor/gc_seconds). gc.callbacks runs in whichever thread triggered the collection, under the GIL."""

    def __init__(self) -> None:
        self._started: float | None = None
        self._spent = 0.0

    def __enter__(self) -> CollectionClock:
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._spent += time.perf_counter() - self._started
            self._started = None

    def take(self) -> float:
        """Seconds spent collecting since the last take."""
        spent, self._spent = self._spent, 0.0
        return spent


def worker_ref_from_env(environ: Mapping[str, str]) -> WorkerRef:
    """The WorkerRef a backend described in MORTAL_RUN / _ROLE / _REPLICA / _INCARNATION."""
    try:
        return WorkerRef(
            run=environ["MORTAL_RUN"],
            role=environ["MORTAL_ROLE"],
            replica=int(environ["MORTAL_REPLICA"]),
            incarnation=int(environ["MORTAL_INCARNATION"]),
            run_uid=environ.get("MORTAL_RUN_UID") or None,
        )
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"not started as a mortal worker: bad or missing environment {exc}") from exc


def load_run(store: Store, name: str) -> TrainingRun:
    """The run as stored now; a stored spec that no longer validates is fatal (it never will)."""
    row = store.get_run(name)
    try:
        return row.document()
    except SpecError as exc:
        raise FatalWorkerError("InvalidSpec", str(exc)) from exc


class WorkerContext:
    """One worker's view of the world: store, identity, run, progress, and the stop signal."""

    def __init__(
        self,
        store: Store,
        worker: WorkerRef,
        run: TrainingRun,
        *,
        heartbeat_seconds: float = DEFAULT_HEARTBEAT_SECONDS,
        run_dir: Path | None = None,
    ) -> None:
        self.store = FencingStore(store)
        self.worker = worker
        self.run = run
        self.run_dir = run_dir if run_dir is not None else paths.run_dir(worker.run)
        self.heartbeat_seconds = heartbeat_seconds
        self.stopping = threading.Event()
        self.log = log
        self._progress: dict[str, int | None] = {"step": None, "weight_version": None}
        self._activities: list[tuple[str, float]] = []  # (what, monotonic start), innermost last
        self._stacks_written_for: datetime | None = None  # the controller's request this worker answered
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, store: Store, environ: Mapping[str, str] | None = None) -> WorkerContext:
        """Identity from the environment, run and lease from the store.

        The heartbeat period is MORTAL_HEARTBEAT_SECONDS when the controller set it, else a third
        of the lease in the worker's row (at most 1 s), so three beats fit in one lease.
        """
        env = os.environ if environ is None else environ
        worker = worker_ref_from_env(env)
        run = load_run(store, worker.run)
        try:  # the controller's memory choices for this incarnation (status.effective), over the spec's
            run = memory.applied(run, env)
        except memory.BadMemorySetting as exc:
            raise FatalWorkerError("InvalidMemorySetting", str(exc)) from exc
        period = env.get("MORTAL_HEARTBEAT_SECONDS")
        if period:
            heartbeat = float(period)
        else:
            heartbeat = min(DEFAULT_HEARTBEAT_SECONDS, _lease_seconds(store, worker) / 3)
        return cls(store, worker, run, heartbeat_seconds=heartbeat)

    # -- progress and liveness ---------------------------------------------------------------
    def report(self, step: int | None = None, weight_version: int | None = None) -> None:
        """Progress the next heartbeat sends (None leaves a value as it was)."""
        with self._lock:
            if step is not None:
                self._progress["step"] = step
            if weight_version is not None:
                self._progress["weight_version"] = weight_version

    @contextlib.contextmanager
    def activity(self, what: str) -> Any:
        """Report `what` (mortal.state.store.ACTIVITIES' kind, then details: "task 3.1") in every heartbeat
        while the block runs, with how long it has run; the innermost of nested blocks is reported."""
        entry = (what, time.monotonic())
        with self._lock:
            self._activities.append(entry)
        try:
            yield
        finally:
            with self._lock:
                self._activities.remove(entry)

    @property
    def name(self) -> str:
        """This worker as events name it: `rollout-0 #3`."""
        return f"{self.worker.role}-{self.worker.replica} #{self.worker.incarnation}"

    def warn(self, reason: str, message: str) -> None:
        """A Warning event of the run (describe, get events); the store being unreachable is only logged:
        the warning is not worth the worker."""
        try:
            self.store.add_event(self.worker.run, "Warning", reason, message)
        except Exception as exc:  # FencingStore already ended a fenced process
            self.log.warning("event %s not recorded: %s", reason, exc)

    def check_fence(self) -> None:
        """Heartbeat now: call before writing files a newer incarnation may also write (exits if fenced)."""
        with self._lock:
            step, version = self._progress["step"], self._progress["weight_version"]
            what, since = self._activities[-1] if self._activities else (None, None)
        seconds = None if since is None else time.monotonic() - since
        row = self.store.heartbeat(
            self.worker, step=step, weight_version=version, activity=what, activity_seconds=seconds
        )
        self._answer_stacks_request(row, what, seconds)

    def _answer_stacks_request(self, row: WorkerRow, what: str | None, seconds: float | None) -> None:
        """The controller asked for this worker's stacks (it ran past the deadline of `what`): every thread's
        stack to the log, once per request, then reported (again on the next beat if the report failed).
        Answered from the heartbeat thread, which still beats while the thread it reports on is stuck: on a
        backend that cannot signal the process (Modal) this is the only way the stacks get out."""
        asked = row.stacks_asked_at
        if asked is None or row.stacks_written_at is not None:
            return
        if asked != self._stacks_written_for:
            doing = "nothing" if what is None else f"{what} for {seconds or 0.0:.0f} s"
            dump_stacks(f"the controller asked for them (this worker was doing {doing})")
            self._stacks_written_for = asked
        self.store.report_stacks(self.worker)

    def start(self) -> None:
        """First heartbeat (Pending -> Running; exits if already fenced), heartbeat thread, SIGTERM
        handler."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
            register_stack_dump()  # the controller asks a stuck worker for its stacks before it kills it
        self.check_fence()
        self._thread = threading.Thread(target=self._beat, name="mortal-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop heartbeating (before the last report, which ends the row: a later beat would be fenced)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.log.info("SIGTERM: stopping at the next step boundary")
        self.stopping.set()

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat_seconds):
            try:
                self.check_fence()
            except Exception as exc:  # the store is unreachable for a moment: keep trying; the lease decides
                self.log.warning("heartbeat failed: %s", exc)


def _lease_seconds(store: Store, worker: WorkerRef) -> float:
    for row in store.list_workers(worker.run):
        if (row.role, row.replica, row.incarnation) == (worker.role, worker.replica, worker.incarnation):
            return row.lease_seconds
    raise Fenced(f"{worker.id} has no row in the store (the run was purged or relaunched)")
