"""`Reconciler.reconcile(name)`: one level-triggered pass over one run (controller-runtime's Reconcile).

Who calls it: the manager's worker threads, one run at a time (the work queue guarantees it), and the
benchmark. Each pass re-reads the world, never trusting an earlier pass: the run, the backend's listing
(before the rows, so an exit it saw was reported first), the worker rows, checkpoints and metrics; then
`plan()`; then it applies the plan's actions and writes status once, guarded by the leader's fence.
Launch protocol, safe against a controller killed at any line: intent row (`create_worker`, new
incarnation) -> `backend.launch` -> `set_worker_handle`. A later pass adopts a process launched but
not recorded, closes an intent never launched, and stops processes no live row owns.
What it must not do: sleep, decide (plan decides), or write without the fence.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from mortal.controller import failpoints, heal
from mortal.controller.actions import Adopt, DumpStacks, EndWorker, Event, Launch, Purge, Stop
from mortal.controller.backends import (
    Backend,
    BackendError,
    InsufficientGPUs,
    Unschedulable,
    WorkerLaunch,
    backend_key,
    select_backend,
)
from mortal.controller.deadlines import Deadlines
from mortal.controller.leader import LeaderElector
from mortal.controller.listing import SharedListing
from mortal.controller.observed import EXIT_FATAL, Desired, Observed, PlanConfig
from mortal.controller.outcome import Done, Outcome, RequeueAfter, Retry, Terminal
from mortal.controller.plan import Plan, plan
from mortal.controller.snapshot import code_environ
from mortal.specs import TrainingSpec
from mortal.state import paths
from mortal.state.auth import launch_token
from mortal.state.containment import PathOutside, report_refused
from mortal.state.errors import Conflict, Fenced, NotFound
from mortal.state.store import LeaderFence, Store, WorkerRef
from mortal.state.tables import RunRow, WorkerRow

log = logging.getLogger("mortal.controller")
REWARD_METRIC = "reward"  # TRL's name, which the actor and the simulated workload both write


@dataclass(frozen=True)
class ControllerConfig:
    """Every timing of the controller in one place; tests shorten them."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    worker_lease_seconds: float = 10.0  # a worker silent this long is lost
    heartbeat_seconds: float | None = None  # None: the worker beats every min(1 s, lease / 3)
    leader_lease_seconds: float = 5.0
    leader_renew_seconds: float = 1.0
    threads: int = field(default_factory=lambda: min(4, max(2, os.cpu_count() or 2)))  # passes in parallel
    # (different runs); more threads than cores only add GIL contention to each pass (docs/benchmarks.md)
    poll_seconds: float = 0.5  # how often run resource versions are compared (changes made elsewhere)
    resync_seconds: float = 15.0  # every run is reconciled at least this often
    retry_base_seconds: float = 0.5
    retry_max_seconds: float = 60.0
    listing_max_age_seconds: float = 0.5  # one backend listing serves all runs' passes this long


class Reconciler:
    """Reconciles one run per call, with the leader's fence, through a store and the backends."""

    def __init__(
        self,
        store: Store,
        state_url: str,
        leader: LeaderElector,
        config: ControllerConfig | None = None,
        backends: Callable[[str], Backend] = select_backend,
    ):
        self.store, self.state_url, self.leader = store, state_url, leader
        self.config = config or ControllerConfig()
        self._select = backends
        self._backends: dict[str, Backend] = {}
        self._listings: dict[str, SharedListing] = {}
        self._lock = threading.Lock()
        self.written: dict[str, int] = {}  # run -> resource_version of our own last status write
        self.durations: deque[float] = deque(maxlen=200_000)  # seconds per pass (benchmarks)

    # -- the pass ---------------------------------------------------------------------------------
    def reconcile(self, name: str) -> Outcome:
        fence = self.leader.fence()
        if fence is None:
            return Done()  # not the leader: the leader reconciles; we get everything when we lead
        started = time.perf_counter()
        try:
            return self._reconcile(name, fence)
        except Fenced as exc:  # another controller leads now: drop the run, it is theirs
            self.leader.lost()
            log.warning("reconcile %s fenced: %s", name, exc)
            return Done()
        except Conflict as exc:
            return Retry(f"conflict: {exc}")
        finally:
            self.durations.append(time.perf_counter() - started)

    def _reconcile(self, name: str, fence: LeaderFence) -> Outcome:
        try:
            run = self.store.get_run(name)
        except NotFound:
            return self._sweep(name)
        try:
            spec = TrainingSpec.model_validate(run.spec)
        except ValidationError as exc:
            return Terminal(f"the stored spec of {name!r} no longer validates: {exc}")
        key = backend_key(spec)
        backend, backend_error = self.backend(key)
        processes = self._listings[key].list(name) if backend is not None else []
        workers = self.store.list_workers(run=name)
        weights = self.store.latest_weights(name)
        metrics = self._metrics(name, workers, run.status)
        newest = metrics[max(metrics)] if metrics else {}
        observed = Observed(
            workers=workers,
            processes=processes,
            status=run.status,
            checkpoint=self.store.latest_checkpoint(name),
            weight_version=weights.version if weights else None,
            weights_at=weights.created_at if weights else None,
            reward=newest.get(REWARD_METRIC),
            metrics=metrics,
            backend_error=backend_error,
        )
        decided = plan(desired_of(run, spec), observed, datetime.now(UTC), self.config.plan)
        return self._apply(run, spec, backend, decided, fence)

    def backend(self, name: str) -> tuple[Backend | None, str | None]:
        """The backend of a key (`backends.backend_key`: the spec's backend, with its Ray address), made once,
        or why it cannot run here."""
        with self._lock:
            if name not in self._backends:
                try:
                    backend = self._select(name)
                except BackendError as exc:
                    return None, str(exc)
                self._backends[name] = backend
                self._listings[name] = SharedListing(backend, self.config.listing_max_age_seconds)
            return self._backends[name], None

    def _metrics(
        self, name: str, workers: list[WorkerRow], status: dict[str, Any]
    ) -> dict[int, dict[str, float]] | None:
        """{step: {metric: value}} of the newest steps the actor reported (one bounded query), or None when
        the actor has not moved since the status was written: the status keeps what they said, no query."""
        steps = [w.step for w in workers if w.role == "actor" and w.step is not None]
        if not steps or (steps[-1] == status.get("step") and status.get("reward") is not None):
            return None
        window = self.config.plan.metrics_window_steps
        by_step: dict[int, dict[str, float]] = {}
        for row in self.store.list_metrics(name, since_step=max(0, steps[-1] - window + 1)):
            by_step.setdefault(row.step, {})[row.name] = row.value
        return by_step

    # -- applying a plan --------------------------------------------------------------------------
    def _apply(
        self, run: RunRow, spec: TrainingSpec, backend: Backend | None, decided: Plan, fence: LeaderFence
    ) -> Outcome:
        failures: list[str] = []
        stops = [a for a in decided.actions if isinstance(a, Stop)]
        signalled = False
        for dump in (a for a in decided.actions if isinstance(a, DumpStacks)):
            # The backend signals the process where it can (the stacks are then written already); the store
            # carries the request to the worker's heartbeat otherwise (Modal). A later pass ends the row.
            written = backend is not None and backend.dump_stacks(dump.handle)
            self.store.request_stacks(dump.worker_id, written=written, fence=fence)
            signalled |= written
        # A hung process is killed before its row is written: frozen mid-transaction, it may hold the
        # very row lock that write needs, and only its death releases it.
        self._stop_all(run.name, backend, [a for a in stops if a.grace_seconds == 0])
        for action in decided.actions:
            if isinstance(action, Adopt):
                self.store.set_worker_handle(action.worker_id, action.handle, fence)
                self._event(run.name, action.event)
            elif isinstance(action, EndWorker):
                self.store.end_worker(action.worker_id, action.state, action.exit_code, action.message, fence)
                self._event(run.name, action.event)
        self._stop_all(run.name, backend, [a for a in stops if a.grace_seconds != 0])
        for action in decided.actions:
            if isinstance(action, Launch) and backend is not None:
                try:
                    self._launch(run, spec, backend, action, fence)
                except BackendError as exc:
                    failures.append(f"launch of {action.role}-{action.replica}: {exc}")
        if backend is not None and any(isinstance(a, Stop | Launch) for a in decided.actions):
            self._listings[backend_key(spec)].invalidate()  # the next pass must see what we just did
        if any(isinstance(a, Purge) for a in decided.actions):
            remove_files = any(a.remove_files for a in decided.actions if isinstance(a, Purge))
            return self._purge(run, remove_files, backend_key(spec), spec.checkpoint.uri, fence)
        if decided.status is not None and decided.status != run.status:
            try:
                row = self.store.write_status(
                    run.name,
                    decided.status,
                    run.resource_version,
                    fence,
                    events=[(e.type, e.reason, e.message) for e in decided.events],
                )
            except Conflict:
                return RequeueAfter(0.0)  # the spec moved under us: look again with the new one
            self.written[run.name] = row.resource_version
        if failures:
            return Retry("; ".join(failures))
        return RequeueAfter(0.0) if signalled else decided.outcome  # a signalled worker's stacks are written

    def _launch(
        self, run: RunRow, spec: TrainingSpec, backend: Backend, action: Launch, fence: LeaderFence
    ) -> None:
        """Intent row, launch, handle: a controller killed between any two leaves something a pass repairs."""
        role = spec.actor if action.role == "actor" else spec.rollout
        launch = WorkerLaunch(
            run=run.name,
            role=action.role,
            replica=action.replica,
            incarnation=0,
            worker_id="",
            state_url=self.state_url,
            mortal_home=str(paths.mortal_home()),
            gpu=role.gpu,
            gpu_count=spec.actor.count if action.role == "actor" else 1,  # a GPU for each rank of the actor
            env={
                **{k: os.environ[k] for k in spec.secrets if k in os.environ},
                **action.env,
                **code_environ(run.annotations),
            },
            heartbeat_seconds=self.config.heartbeat_seconds,
            run_uid=run.uid,
            colocate=action.role == "rollout" and spec.rollout.colocated(action.replica),
            # the ring of weight snapshots is on the actor's (rank 0's) GPU, which a rollout on another GPU
            # must see
            sees_actor_gpus=(
                action.role == "rollout"
                and (not spec.rollout.colocated(action.replica) or spec.actor.count > 1)
                and spec.sync_method() in ("ipc", "nccl")
            ),
            engine=spec.generation.engine,
        )
        if spec.backend == "ray":
            wants = spec.ray.actor if action.role == "actor" else spec.ray.rollout
            launch = dataclasses.replace(
                launch,
                cpus=wants.cpus,
                resources=dict(wants.resources),
                memory_bytes=None if wants.memory_gb is None else int(wants.memory_gb * 2**30),
                node_home=not spec.ray.shared_filesystem,
                log_uri=None if spec.ray.shared_filesystem else spec.checkpoint.uri,
            )
        row = self.store.create_worker(
            run.name,
            action.role,
            action.replica,
            backend.name,
            self.config.worker_lease_seconds,
            fence,
            gpus=backend.gpus_held(launch),
        )
        ref = WorkerRef(run.name, action.role, action.replica, row.incarnation, run_uid=run.uid)
        launch = dataclasses.replace(
            launch,
            incarnation=row.incarnation,
            worker_id=ref.process_id,
            state_token=launch_token(self.state_url, ref, run.uid),
        )
        failpoints.hit("launch:after-intent")
        if self.leader.fence() != fence:
            raise Fenced("the leader lease ran out before a launch")
        try:
            handle = backend.launch(launch)
        except BackendError as exc:
            self._launch_failed(run.name, row, action, exc, fence)
            raise
        failpoints.hit("launch:after-launch")
        self.store.set_worker_handle(_row_id(row), handle, fence)
        self._event(
            run.name,
            Event(
                action.event.type,
                action.event.reason,
                f"{action.event.message} as incarnation {row.incarnation}",
            ),
        )

    def _launch_failed(
        self, name: str, row: WorkerRow, action: Launch, exc: BackendError, fence: LeaderFence
    ) -> None:
        """Close the intent row: a machine without that many GPUs, or a cluster with no node that can ever
        hold the worker (Unschedulable), fails the run (exit 3); GPUs busy for now is no failure of the
        worker (Stopped: retried with the queue's backoff, no restart counted); any other launch error
        counts as a failed start (backoff, restarts, maxRestarts)."""
        if isinstance(exc, InsufficientGPUs) and not exc.permanent:
            state, code, reason = "Stopped", None, "InsufficientGPUs"
        else:
            fatal = isinstance(exc, InsufficientGPUs | Unschedulable)
            state, code, reason = "Failed", EXIT_FATAL if fatal else None, "LaunchFailed"
        self.store.end_worker(_row_id(row), state, code, f"launch failed: {exc}", fence)
        self._event(name, Event("Warning", reason, f"{action.role}-{action.replica}: {exc}"))

    def _stop_all(self, name: str, backend: Backend | None, stops: list[Stop]) -> None:
        """Each stop blocks until its process is gone (up to its grace): run them side by side."""
        if backend is None or not stops:
            return

        def stop(action: Stop) -> None:
            backend.stop(action.handle, action.grace_seconds)
            self._event(name, action.event)

        if len(stops) == 1:
            stop(stops[0])
            return
        with ThreadPoolExecutor(max_workers=min(8, len(stops))) as pool:
            for done in [pool.submit(stop, a) for a in stops]:
                done.result()

    def _purge(
        self, run: RunRow, remove_files: bool, backend_name: str, storage_uri: str | None, fence: LeaderFence
    ) -> Outcome:
        """Files first, where the run's backend keeps them (a Modal run's are on its volume) and in its
        checkpoint storage (spec.checkpoint.uri: checkpoints and uploaded logs), rows last: the row going
        away is what says the deletion is complete. A run whose backend or storage cannot be reached from
        here keeps its rows (BackendError: the pass is retried) rather than leave files no one will remove.
        A run whose folder would lie outside MORTAL_HOME/runs or is a link (PathOutside) has its rows purged,
        its files left alone, and a Warning event that says so and stays after it. Files kept (no --purge)
        are moved to a folder named by the run's uid (Backend.set_aside_run_folder)."""
        name = run.name
        refused: PathOutside | None = None
        backend, why = self.backend(backend_name)
        if backend is None:
            if remove_files:
                raise BackendError(f"cannot remove the files of run {name!r}: {why}")
        elif self.leader.fence() != fence:
            raise Fenced("the leader lease ran out before removing files")
        else:
            try:
                if remove_files:
                    backend.remove_run_files(name, storage_uri)
                else:
                    backend.set_aside_run_folder(name, run.uid)
            except PathOutside as exc:  # a name stored before the store checked names: never followed
                refused = exc
        self.store.purge_run(name, fence)
        self.written.pop(name, None)
        if refused is not None:  # after the purge, so that it outlives the run's own events (`get events`)
            kept = "not removed" if remove_files else "not moved aside"
            what = f"deleted with its files left where they are, {kept}"
            log.warning("run %r %s: %s", name, what, refused)
            report_refused(self.store, name, what, refused)
        log.info("purged run %s%s", name, " and its files" if remove_files and refused is None else "")
        return Done()

    def _sweep(self, name: str) -> Outcome:
        """The run is gone from the store: stop any process still carrying its name."""
        for backend in list(self._backends.values()):
            for worker in backend.list(run=name):
                if worker.alive:
                    log.warning("stopping %s: its run no longer exists", worker.worker_id)
                    backend.stop(worker.handle, self.config.plan.orphan_grace_seconds)
        return Done()

    def _event(self, run: str, event: Event | None) -> None:
        if event is not None:
            self.store.add_event(run, event.type, event.reason, event.message)


def desired_of(run: RunRow, spec: TrainingSpec) -> Desired:
    """The parts of a stored run the planner acts on."""
    return Desired(
        name=run.name,
        uid=run.uid,
        generation=run.generation,
        backend=spec.backend,
        rollout_replicas=spec.rollout.replicas,
        suspend=spec.suspend,
        max_steps=spec.algorithm.max_steps,
        max_restarts=spec.restart_policy.max_restarts,
        backoff_seconds=spec.restart_policy.backoff_seconds,
        same_failure_limit=spec.restart_policy.same_failure_limit,
        max_staleness=spec.algorithm.max_staleness,
        sync_every=spec.sync.every,
        checkpoint_every=spec.checkpoint.every,
        colocate=spec.rollout.shares_actor_gpu,
        lora=spec.model.lora is not None,
        gradient_checkpointing=spec.model.gradient_checkpointing,
        micro_batch_size=spec.algorithm.batch_size // spec.algorithm.accumulation_steps,
        batch_size=spec.algorithm.batch_size,
        fitted_micro_batch=_fitted_micro_batch(run),
        loss_type=spec.algorithm.loss_type,
        rollout_share=spec.rollout.gpu_memory_utilization,
        actor_ranks=spec.actor.count,
        cpu_offload=spec.actor.cpu_offload,
        reshard_after_forward=spec.actor.reshard_after_forward,
        replicated=spec.actor.strategy == "ddp",
        deleted=run.deleted_at is not None,
        purge=run.purge_requested,
        max_duration=spec.limits.max_duration,
        max_gpu_hours=spec.limits.max_gpu_hours,
        deadlines=Deadlines(
            task_seconds=spec.deadlines.task_seconds,
            step_seconds=spec.deadlines.step_seconds,
            weight_load_seconds=spec.deadlines.weight_load(),
            reward_seconds=sum(r.timeout_seconds for r in spec.rewards),
        ),
    )


def _row_id(row: WorkerRow) -> int:
    """The id the store gave a row it created (one it returns always has it)."""
    if row.id is None:
        raise ValueError(f"worker row {row.role}-{row.replica} #{row.incarnation} has no id")
    return row.id


def _fitted_micro_batch(run: RunRow) -> int | None:
    """mortalctl apply's micro batch estimate (heal.FITTED_ANNOTATION); None when absent or not a number
    (the planner checks it against the spec)."""
    value = (run.annotations or {}).get(heal.FITTED_ANNOTATION)
    return int(value) if value is not None and value.isdigit() else None
