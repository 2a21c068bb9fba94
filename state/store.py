"""The Store interface: every read and write of mortal's state goes through one of these methods.

Who calls it: the CLI (desired state: apply, scale, suspend, delete), the controller (status,
workers, events, leases) and workers (heartbeats, metrics, checkpoints, weights, the task queue).
What it must not do: decide anything. It enforces only invariants that make concurrent writers
safe: optimistic concurrency on runs (`resource_version`), fencing of stale worker incarnations and
of a leader that lost its lease, guarded task leases.

Two implementations: `SqlStore` (SQLite or PostgreSQL, mortal.state.sql_store) and `HttpStore`
(mortal.state.http_store: the same contract served over HTTP by mortal.state.http_server, for
workers on Modal). `tests/state/test_store_contract.py` runs one suite against each.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from mortal.state.tables import (
    CheckpointRow,
    CompletionRow,
    EventRow,
    LeaseRow,
    MetricRow,
    RunRow,
    TaskRow,
    WeightRow,
    WorkerRow,
)

ACTIVITIES = ("task", "step", "weight-load")
"""What a worker may report doing in its heartbeat (workers.activity's first word), each with a deadline
(spec.deadlines; mortal.controller.deadlines). Collectives are not reported: torch.distributed's own
timeout (spec.deadlines.collectiveSeconds) fails them in the worker."""
MAX_ACTIVITY_CHARS = 200
MAX_ACTIVITY_SECONDS = 365 * 86400.0


def check_activity(activity: str | None) -> str | None:
    """An activity as a worker reported it, if well formed (a kind of ACTIVITIES, then printable text): the
    store keeps only that, so what `describe` prints of it is bounded text."""
    if activity is None:
        return None
    kind = activity.split(" ", 1)[0]
    if kind not in ACTIVITIES or len(activity) > MAX_ACTIVITY_CHARS or not activity.isprintable():
        raise ValueError(
            f"heartbeat: activity must be one of {', '.join(ACTIVITIES)}, then printable text "
            f"(at most {MAX_ACTIVITY_CHARS} characters), not {activity[:MAX_ACTIVITY_CHARS]!r}"
        )
    return activity


def activity_age(seconds: float | None) -> float:
    """A reported activity's age, bounded (a worker's number is not trusted: NaN, negative or huge)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return 0.0
    return min(seconds, MAX_ACTIVITY_SECONDS)


class ApplyOutcome(StrEnum):
    """What `apply_run` did, printed by `mortalctl apply` as `trainingrun/NAME <outcome>`."""

    created = "created"
    configured = "configured"
    unchanged = "unchanged"


class CompletionOrder(StrEnum):
    """How `list_completions` orders samples: as sampled, or by total reward (unscored ones last)."""

    sample = "sample"  # by step, then position in the step's batch
    worst = "worst"  # lowest total reward first
    best = "best"  # highest total reward first


@dataclass(frozen=True)
class WorkerRef:
    """Who is writing: a worker identifies itself by its slot and incarnation (the fencing token).

    `run_uid`, when set, is the uid of the run the worker was launched for: incarnations count from 1
    again when a run is purged and created anew under its name, and the uid is what then tells a
    leftover worker of the old run from the new run's worker of the same number.
    """

    run: str
    role: str
    replica: int
    incarnation: int
    run_uid: str | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return f"{self.run}/{self.role}-{self.replica}#{self.incarnation}"

    @property
    def process_id(self) -> str:
        """The marker a backend finds the worker's process by (MORTAL_WORKER_ID, a Modal registry key, a Ray
        actor's name): the id and, when known, the run's uid, so that a process of an earlier run of the same
        name (whose incarnations counted from 1 as well) is never taken for this run's worker."""
        return f"{self.id}@{self.run_uid}" if self.run_uid else self.id


# "1" in the environment a backend launches a worker process with; the worker sets it to "0" in its own
# environment first thing (mortal.workers.main), so its children, which inherit MORTAL_WORKER_ID, are never
# taken for the worker (a child that left the worker's process group led a group carrying its id once the
# worker was killed: LocalBackend listed it as the live worker). Absent: a worker an earlier controller
# launched, still found as it was then.
WORKER_LEADER_ENV = "MORTAL_WORKER_LEADER"


@dataclass(frozen=True)
class LeaderFence:
    """Carried by controller writes: valid only while lease `name` is held by `holder` with `token`."""

    name: str
    holder: str
    token: int


@dataclass(frozen=True)
class NewTask:
    """A task as the actor enqueues it."""

    step: int
    slot: int
    min_weight_version: int
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NewCompletion:
    """A sampled completion as the actor records it (mortal.state.tables.CompletionRow says each field)."""

    sample: int
    prompt: str
    completion: str
    rewards: dict[str, float | None]
    reward: float | None
    advantage: float | None
    weight_version: int
    extra: dict[str, Any] = field(default_factory=dict)


# The event reason of a step's rollouts dropped as stale (feed._requeue).
STALE_ROLLOUTS = "StaleRolloutsDropped"


@dataclass(frozen=True)
class TaskTally:
    """The task queue of one run, counted (Store.task_tally): the store's share of `mortalctl describe`'s
    ledger.

    Counts what the queue holds now: a resumed actor deletes the tasks of the steps after its checkpoint and
    queues them again, so those count once. `releases` are leases beyond each task's first: the task was
    leased again after its worker died (its row ended) or its lease ran out. `stale_drops` counts the
    StaleRolloutsDropped events: steps whose rollouts the actor dropped as too stale and queued again."""

    steps: int = 0
    tasks: int = 0
    done: int = 0
    releases: int = 0
    stale_drops: int = 0


class Store(abc.ABC):
    """The contract. Methods raise mortal.state.errors types; rows come back detached."""

    # -- lifecycle -------------------------------------------------------------------------
    @abc.abstractmethod
    def migrate(self) -> None:
        """Bring the schema to the newest version (idempotent; safe from several processes)."""

    @abc.abstractmethod
    def close(self) -> None: ...

    # -- runs: desired state ---------------------------------------------------------------
    @abc.abstractmethod
    def apply_run(
        self,
        name: str,
        spec: dict[str, Any],
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        applied: dict[str, Any] | None = None,
        resource_version: int | None = None,
        dry_run: bool = False,
    ) -> tuple[RunRow, ApplyOutcome]:
        """Create the run, or replace its spec/labels/annotations and the fields its document set
        (`applied`, kept for the next apply's three-way merge). Spec, labels and annotations all equal
        -> unchanged, and `applied` is kept as it was (a document that spells out what the run already
        has, such as `get -o yaml`'s, does not take over its fields), unless the run had none (a fork).

        A changed spec bumps generation and resource_version; labels or annotations alone bump
        resource_version. Equality is JSON equality of the
        normalized dicts. `resource_version`: the version the caller merged against, 0 for "no such run",
        None for no precondition; Conflict if the run moved or was created since, and whenever it is
        being deleted (mortal.state.apply_document re-reads and merges again).
        InvalidName for a name, label or annotation key the spec would refuse (mortal.state.names):
        names become folders and process names.
        `dry_run`: every check and the outcome, the row as it would be, nothing written (the transaction is
        rolled back), as kubectl's --dry-run=server: `mortalctl apply --dry-run` asks the store itself.
        """

    @abc.abstractmethod
    def fork_run(
        self,
        name: str,
        spec: dict[str, Any],
        labels: dict[str, str],
        annotations: dict[str, str],
        parent: str,
        parent_step: int,
        checkpoint_path: str,
        weight_version: int,
        provenance: dict[str, Any] | None = None,
    ) -> RunRow:
        """Create run `name` forked from `parent` at `parent_step` (its lineage columns set) together with
        its complete checkpoint row of that step at `checkpoint_path` (files already in place), in one
        transaction: the controller never sees the run without the checkpoint it resumes from. `provenance`
        is the parent checkpoint's, so the child's resume is verified against what made it.
        Conflict if a run of that name exists (being deleted or not); InvalidName as apply_run."""

    @abc.abstractmethod
    def rollback_run(self, name: str, step: int) -> list[CheckpointRow]:
        """Forget what the run did after `step`, so it resumes from its checkpoint of `step` as if the
        later steps never ran: checkpoint rows of later steps (returned: the caller moves or removes their
        files after), metrics, completions and tasks of later steps; ended worker rows that reported a
        later step report `step`. Weight versions stay (they only grow). NotFound without the run or its
        complete checkpoint of `step`; Conflict while a worker of the run is live or it is being deleted."""

    @abc.abstractmethod
    def get_run(self, name: str) -> RunRow:
        """The run, including one marked deleted but not yet purged. NotFound otherwise."""

    @abc.abstractmethod
    def run_uid(self, name: str) -> str | None:
        """The uid of the run named `name` now (one marked deleted included), None when there is none: one
        indexed read, for the HTTP server to tell a worker token of an earlier run of that name
        (mortal.state.auth.check_run_uid)."""

    @abc.abstractmethod
    def list_runs(self, labels: dict[str, str] | None = None, include_deleted: bool = True) -> list[RunRow]:
        """Runs by name; `labels` is an equality selector (all must match)."""

    @abc.abstractmethod
    def update_spec(self, name: str, spec: dict[str, Any], resource_version: int) -> RunRow:
        """Compare-and-swap of the spec (scale, suspend, resume): Conflict if the version moved
        or the run is being deleted. generation + 1 only if the spec actually changed."""

    @abc.abstractmethod
    def write_status(
        self,
        name: str,
        status: dict[str, Any],
        resource_version: int | None = None,
        fence: LeaderFence | None = None,
        events: Sequence[tuple[str, str, str]] = (),
    ) -> RunRow:
        """Replace status (and the phase column). Generation stays; resource_version + 1.

        With `resource_version`, Conflict if the row moved since it was read. With `fence`, Fenced
        unless the lease is still held with that token (checked in the same transaction).
        `events` are (type, reason, message) lines that this status change explains, added in the same
        transaction: a reader who sees phase Succeeded also sees the event that says so, and a
        controller killed after the write cannot lose them.
        """

    @abc.abstractmethod
    def mark_deleted(self, name: str, purge: bool = False) -> RunRow:
        """Request deletion (sets deleted_at; idempotent); the controller stops workers and then purges."""

    @abc.abstractmethod
    def purge_run(self, name: str, fence: LeaderFence | None = None) -> None:
        """Remove the run and every row that belongs to it (workers, tasks, events, ...). NotFound if
        absent."""

    # -- workers ---------------------------------------------------------------------------
    @abc.abstractmethod
    def create_worker(
        self,
        run: str,
        role: str,
        replica: int,
        backend: str,
        lease_seconds: float,
        fence: LeaderFence | None = None,
        gpus: int = 0,
    ) -> WorkerRow:
        """Record the intent to launch a slot, with a new incarnation (greater than any in the run).

        Recorded *before* the launch so a controller killed in between finds the row on restart.
        The new row is in state Pending. NotFound without the run; Conflict if it is being deleted.
        `gpus`: the GPUs the worker will hold (Backend.gpus_held), for its GPU time.
        InvalidName unless `role` is a DNS-1123 label (it names log files and processes).
        """

    @abc.abstractmethod
    def set_worker_handle(
        self, worker_id: int, handle: str, fence: LeaderFence | None = None
    ) -> WorkerRow: ...

    @abc.abstractmethod
    def end_worker(
        self,
        worker_id: int,
        state: str,
        exit_code: int | None = None,
        message: str | None = None,
        fence: LeaderFence | None = None,
    ) -> WorkerRow:
        """Mark a worker Succeeded | Failed | Lost | Stopped (terminal; later worker writes are fenced).

        The tasks still leased to this incarnation are queued again in the same transaction, claimable
        at once (not when their leases run out); other workers' and newer incarnations' leases stay.
        A worker already ended keeps its first terminal state (returned unchanged). NotFound, ValueError.
        """

    @abc.abstractmethod
    def list_workers(self, run: str | None = None, live_only: bool = False) -> list[WorkerRow]:
        """Workers of a run (all runs if None); live_only drops terminal states."""

    @abc.abstractmethod
    def heartbeat(
        self,
        worker: WorkerRef,
        step: int | None = None,
        weight_version: int | None = None,
        activity: str | None = None,
        activity_seconds: float | None = None,
    ) -> WorkerRow:
        """Record liveness (Pending -> Running). Fenced if `worker` is not the slot's live incarnation.
        `activity` (check_activity) is what it is doing, for `activity_seconds` by its own clock (None: idle);
        the store keeps activity_since on its own clock, now minus those seconds."""

    @abc.abstractmethod
    def request_stacks(
        self, worker_id: int, written: bool = False, fence: LeaderFence | None = None
    ) -> WorkerRow:
        """Ask a live worker for its Python stacks (it stalled): stacks_asked_at becomes now, and
        stacks_written_at now as well with `written` (the controller's backend signalled the process, which
        wrote them itself), else None until the worker reports them (report_stacks). A new request replaces
        an earlier one. An ended worker's row is returned unchanged. NotFound."""

    @abc.abstractmethod
    def report_stacks(self, worker: WorkerRef) -> WorkerRow:
        """The worker wrote its stacks to its log, as its heartbeat's row asked (stacks_asked_at): sets
        stacks_written_at, once per request (a second report leaves it). Fenced like heartbeat."""

    @abc.abstractmethod
    def report_exit(
        self, worker: WorkerRef, state: str, exit_code: int, message: str | None = None
    ) -> WorkerRow:
        """A worker's own last word (Succeeded / Failed) before it exits; its task leases are released
        as by end_worker. Fenced like heartbeat."""

    # -- checkpoints, weights ----------------------------------------------------------------
    @abc.abstractmethod
    def record_checkpoint(
        self,
        worker: WorkerRef,
        step: int,
        path: str,
        weight_version: int,
        provenance: dict[str, Any] | None = None,
    ) -> CheckpointRow:
        """Record a checkpoint whose files are already complete on disk (complete=True), with what made it
        (`provenance`, mortal.workers.actor.provenance). Fenced."""

    @abc.abstractmethod
    def list_checkpoints(self, run: str, complete_only: bool = True) -> list[CheckpointRow]:
        """Oldest first."""

    @abc.abstractmethod
    def latest_checkpoint(self, run: str) -> CheckpointRow | None: ...

    @abc.abstractmethod
    def delete_checkpoint(self, worker: WorkerRef, step: int) -> None:
        """Forget a checkpoint row (retention); the caller removes its files after. Fenced."""

    @abc.abstractmethod
    def publish_weights(
        self,
        worker: WorkerRef,
        version: int,
        step: int,
        path: str,
        method: str = "volume",
        provenance: dict[str, Any] | None = None,
    ) -> WeightRow:
        """Record weights already written at `path`, with what made them (`provenance`). Conflict unless
        version > every earlier one."""

    @abc.abstractmethod
    def latest_weights(self, run: str) -> WeightRow | None: ...

    @abc.abstractmethod
    def list_weights(self, run: str) -> list[WeightRow]: ...

    @abc.abstractmethod
    def delete_weights(self, worker: WorkerRef, version: int) -> None: ...

    # -- events, metrics ---------------------------------------------------------------------
    @abc.abstractmethod
    def add_event(self, run: str, type: str, reason: str, message: str) -> EventRow: ...

    @abc.abstractmethod
    def list_events(
        self, run: str | None = None, limit: int = 50, before_id: int | None = None
    ) -> list[EventRow]:
        """Newest `limit` events (older than the event `before_id`, to page back), returned oldest first."""

    @abc.abstractmethod
    def add_metrics(self, worker: WorkerRef, step: int, values: dict[str, float]) -> None:
        """Record several scalars for one step (fenced)."""

    @abc.abstractmethod
    def list_metrics(
        self, run: str, name: str | None = None, since_step: int | None = None
    ) -> list[MetricRow]:
        """Ordered by step, then name; `since_step` is inclusive (step >= since_step).

        A step recorded again (after a resume) keeps one value per (step, name): the latest."""

    @abc.abstractmethod
    def add_completions(self, worker: WorkerRef, step: int, completions: list[NewCompletion]) -> None:
        """Record a step's sampled completions (fenced); they replace any the step had (a resume)."""

    @abc.abstractmethod
    def list_completions(
        self,
        run: str,
        step: int | None = None,
        order: CompletionOrder = CompletionOrder.sample,
        limit: int | None = None,
    ) -> list[CompletionRow]:
        """The samples of `step` (every step if None) in `order`, the first `limit` of them (ValueError if
        < 1)."""

    @abc.abstractmethod
    def completion_steps(self, run: str) -> list[int]:
        """The steps that have recorded completions, ascending."""

    # -- leases (leader election) ------------------------------------------------------------
    @abc.abstractmethod
    def acquire_lease(
        self, name: str, holder: str, duration_seconds: float, now: datetime | None = None
    ) -> LeaseRow | None:
        """Take or renew the lease. Returns it when `holder` holds it afterwards, None when another
        holder's lease is unexpired. A new holder gets token + 1; a renewal keeps the token."""

    @abc.abstractmethod
    def release_lease(self, name: str, holder: str) -> None:
        """Expire `holder`'s lease now (no-op if another holds it); the next holder still gets token + 1."""

    @abc.abstractmethod
    def get_lease(self, name: str) -> LeaseRow | None: ...

    # -- the rollout task queue ----------------------------------------------------------------
    @abc.abstractmethod
    def enqueue_tasks(self, worker: WorkerRef, tasks: list[NewTask]) -> int:
        """Insert tasks not yet present (idempotent on (run, step, slot)); returns how many were new."""

    @abc.abstractmethod
    def reset_tasks(self, worker: WorkerRef, from_step: int) -> int:
        """Delete every task of step >= from_step (actor resumed from a checkpoint); returns count."""

    @abc.abstractmethod
    def lease_task(
        self,
        worker: WorkerRef,
        lease_seconds: float,
        max_weight_version: int | None = None,
        now: datetime | None = None,
    ) -> TaskRow | None:
        """Claim the oldest claimable task: queued (new, or released when its holder ended), or leased
        with an expired lease, and (when given) min_weight_version <= max_weight_version. Bumps
        lease_token and attempts. Fenced."""

    @abc.abstractmethod
    def renew_task(self, worker: WorkerRef, task_id: int, lease_token: int, lease_seconds: float) -> bool:
        """Extend a lease still held (False if it was lost)."""

    @abc.abstractmethod
    def complete_task(
        self, worker: WorkerRef, task_id: int, lease_token: int, result: dict[str, Any]
    ) -> bool:
        """Store the result if the lease is still ours (token matches, task not done). False otherwise."""

    @abc.abstractmethod
    def step_results(self, run: str, step: int) -> list[TaskRow]:
        """All tasks of a step, by slot (callers check every one is done)."""

    @abc.abstractmethod
    def task_tally(self, run: str) -> TaskTally:
        """How many steps, tasks and done tasks the run's queue holds, how often its tasks were leased again,
        and how often the actor dropped a step's rollouts as stale (events with reason STALE_ROLLOUTS)."""

    @abc.abstractmethod
    def step_states(self, run: str, step: int) -> list[str]:
        """The state of each task of a step, by slot: what a waiter polls, without the payloads and results
        step_results reads (the results a step's finished tasks hold are read once, when all are done)."""
