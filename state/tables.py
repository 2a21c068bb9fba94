"""SQLModel tables of the state store: the one record of what every run wants and what happened.

Only `mortal.state` imports this module to read or write SQL; other layers receive these rows as
plain (detached) pydantic objects from the `Store`. Invariants live in the column comments, so the
migration, the Store and the reader agree on one description.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Column, DateTime, Index, Table, UniqueConstraint, text
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

if TYPE_CHECKING:
    from mortal.specs import TrainingRun


def utcnow() -> datetime:
    """Timezone-aware now; every timestamp in the store is UTC."""
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """`value` in UTC; a naive value is taken to be UTC already."""
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class UtcDateTime(TypeDecorator):
    """A timestamp that always comes back timezone-aware in UTC.

    PostgreSQL keeps `timestamptz`; SQLite keeps the UTC wall time as text and hands back naive
    values, which are marked UTC here. Naive values given to the store are taken as UTC.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else as_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else as_utc(value)


def _time(default_now: bool = True, **kw: Any) -> Any:
    """A UTC timestamp column (now by default, else None)."""
    if default_now:
        return Field(default_factory=utcnow, sa_type=UtcDateTime, **kw)
    return Field(default=None, sa_type=UtcDateTime, **kw)


class RunRow(SQLModel, table=True):
    """One TrainingRun: desired state (spec) and observed state (status)."""

    __tablename__ = "runs"

    name: str = Field(primary_key=True, description="metadata.name, a DNS-1123 label")
    uid: str = Field(description="uuid4; a run deleted and created again under one name gets a new uid")
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    annotations: dict[str, str] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False, server_default="{}"),
        description="metadata.annotations (added in migration 0002)",
    )
    spec: dict[str, Any] = Field(
        sa_column=Column(JSON, nullable=False),
        description="the normalized spec (camelCase keys, defaults filled) as `TrainingRun.spec` dumps it",
    )
    applied: dict[str, Any] | None = Field(
        default=None,
        sa_column=Column(JSON, nullable=True),
        description="the spec fields the last apply's document set (TrainingRun.applied_config), which the "
        "next apply merges against; None for a run never applied (forked) (added in migration 0011)",
    )
    generation: int = Field(default=1, description="+1 on every change of spec; status writes leave it")
    resource_version: int = Field(default=1, description="+1 on every write of this row, spec or status")
    phase: str = Field(default="Pending", index=True, description="copy of status.phase, for queries")
    status: dict[str, Any] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False),
        description="the status block (camelCase), written only through Store.write_status",
    )
    created_at: datetime = _time()
    updated_at: datetime = _time()
    deleted_at: datetime | None = _time(
        False, description="deletion requested; the controller stops workers, then purges the row"
    )
    purge_requested: bool = Field(default=False, description="delete --purge: remove checkpoints too")
    forked_from: str | None = Field(
        default=None,
        description="lineage: the run this one was forked from (its name then; it may be gone "
        "since); None for a run applied from scratch (added in migration 0005)",
    )
    forked_from_step: int | None = Field(
        default=None, description="lineage: the step of forked_from's checkpoint this run started from"
    )

    def document(self) -> TrainingRun:
        """This row as the TrainingRun document `get -o yaml` prints and workers read their spec from.

        Raises mortal.specs.SpecError when the stored spec no longer validates.
        """
        from mortal.specs import TrainingRun

        return TrainingRun.from_record(
            self.name,
            self.spec,
            self.status,
            labels=self.labels,
            annotations=self.annotations,
            uid=self.uid,
            generation=self.generation,
            resource_version=self.resource_version,
            creation_timestamp=self.created_at,
            deletion_timestamp=self.deleted_at,
        )


class WorkerRow(SQLModel, table=True):
    """One launch of one worker slot (run, role, replica). A relaunch is a new row, incarnation + 1."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("run", "role", "replica", "incarnation", name="uq_workers_slot_incarnation"),
    )

    id: int | None = Field(default=None, primary_key=True)
    run: str = Field(index=True)
    role: str = Field(description="actor | rollout")
    replica: int = Field(description="0-based index within the role")
    incarnation: int = Field(
        description="fencing token: strictly increasing per run across all slots; only the newest "
        "incarnation of a slot may write"
    )
    backend: str = Field(description="local | modal")
    handle: str | None = Field(
        default=None, description="the backend's id of the process/call; None until known"
    )
    state: str = Field(
        default="Pending",
        description="Pending (recorded, maybe launching) | Running (heartbeat seen) | Succeeded | Failed | "
        "Lost (no heartbeat / process gone) | Stopped (stopped by the controller)",
    )
    heartbeat_at: datetime | None = _time(False)
    lease_seconds: float = Field(
        default=10.0, description="a heartbeat older than this means the worker is lost"
    )
    step: int | None = None
    weight_version: int | None = None
    exit_code: int | None = None
    message: str | None = None
    started_at: datetime = _time()
    ended_at: datetime | None = _time(False)
    gpus: int = Field(
        default=0,
        sa_column_kwargs={"server_default": "0"},
        description="GPUs this worker holds (its own; a colocated rollout's share of its actor's is 0), as "
        "the backend gives them at launch: its wall time x this is its GPU time (spec.limits.maxGPUHours; "
        "added in migration 0004)",
    )
    activity: str | None = Field(
        default=None,
        description="what the worker reported doing in its newest heartbeat: a kind of ACTIVITIES, then what "
        "(`task 3.1`, `step 7`); None while idle. The controller relaunches it when it lasts past the kind's "
        "deadline (mortal.controller.deadlines; added in migration 0008)",
    )
    activity_since: datetime | None = _time(False, description="when that activity began (the store's clock)")
    stacks_asked_at: datetime | None = _time(
        False,
        description="when the controller asked this worker for its Python stacks (it stalled: past the "
        "deadline of its activity), on the store's clock; the worker's heartbeat thread answers by writing "
        "them to its log (mortal.workers.deadline). None: not asked (added in migration 0009)",
    )
    stacks_written_at: datetime | None = _time(
        False,
        description="when the stacks asked for at stacks_asked_at were written to the worker's log: reported "
        "by the worker (report_stacks), or by the controller when its backend signalled the process itself. "
        "None: not (yet) written",
    )


class CheckpointRow(SQLModel, table=True):
    """A checkpoint; readers see it only once `complete` (its files renamed into place, row committed)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run", "step", name="uq_checkpoints_run_step"),)

    id: int | None = Field(default=None, primary_key=True)
    run: str = Field(index=True)
    step: int
    path: str
    weight_version: int
    complete: bool = False
    created_at: datetime = _time()
    provenance: dict[str, Any] | None = Field(
        default=None,
        sa_column=Column(JSON, nullable=True),
        description="what made it (mortal.workers.actor.provenance): spec generation, reward code and "
        "dataset hashes, data position; None for checkpoints written before migration 0006",
    )


class WeightRow(SQLModel, table=True):
    """A published weight version: what rollout workers load between batches."""

    __tablename__ = "weights"

    run: str = Field(primary_key=True)
    version: int = Field(primary_key=True, description="strictly increasing per run, never reused")
    step: int = Field(description="the optimizer step these weights are the result of")
    path: str = Field(description="where the (atomically written) weights lie on the shared volume")
    method: str = Field(default="volume")
    created_at: datetime = _time()
    provenance: dict[str, Any] | None = Field(
        default=None,
        sa_column=Column(JSON, nullable=True),
        description="what made these weights (as CheckpointRow.provenance); None before migration 0006",
    )


class EventRow(SQLModel, table=True):
    """What `describe` and `get events` show: one line per thing that happened to a run."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_time", "run", "time"),)

    id: int | None = Field(default=None, primary_key=True)
    run: str
    type: str = Field(description="Normal | Warning")
    reason: str = Field(description="CamelCase machine-readable cause, e.g. WorkerLost")
    message: str
    time: datetime = _time()


class MetricRow(SQLModel, table=True):
    """One scalar per (run, step, name): reward/mean, loss, kl, tokens_per_second, ..."""

    __tablename__ = "metrics"
    __table_args__ = (
        Index("ix_metrics_run_name_step", "run", "name", "step"),
        # One value per name: add_metrics upserts on it (migration 0010 says why).
        Index("uq_metrics_run_step_name", "run", "step", "name", unique=True),
    )

    id: int | None = Field(default=None, primary_key=True)
    run: str
    step: int
    name: str
    value: float
    time: datetime = _time()


class CompletionRow(SQLModel, table=True):
    """One sampled completion as the actor trained on it: what `mortalctl get completions` shows.

    The actor records at most spec.logging.completionsPerStep of them per step; a step recorded
    again (after a resume) replaces that step's rows, as metrics do.
    """

    __tablename__ = "completions"
    __table_args__ = (UniqueConstraint("run", "step", "sample", name="uq_completions_run_step_sample"),)

    id: int | None = Field(default=None, primary_key=True)
    run: str
    step: int = Field(description="the optimizer step that trained on this sample")
    sample: int = Field(description="position in the step's batch: prompt slot x numGenerations + generation")
    prompt: str = Field(description="the prompt as text (chat messages as 'role: content' blocks)")
    completion: str = Field(description="the completion as text, in full")
    rewards: dict[str, float | None] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False),
        description="each reward's own score by reward name (None: that reward did not score it)",
    )
    reward: float | None = Field(
        default=None, description="the weighted sum of `rewards`, as TRL sums them; None when none scored it"
    )
    advantage: float | None = Field(
        default=None, description="the advantage TRL trained with; None if unknown"
    )
    weight_version: int = Field(description="the weight version that generated the completion")
    extra: dict[str, Any] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False),
        description="the columns reward functions passed to TRL's log_extra, one value each",
    )
    time: datetime = _time()


class LeaseRow(SQLModel, table=True):
    """A named lease (controller leader election). `token` grows with each new holder: a fencing token."""

    __tablename__ = "leases"

    name: str = Field(primary_key=True)
    holder: str
    token: int = 1
    expires_at: datetime = Field(sa_type=UtcDateTime)
    renewed_at: datetime = _time()


OPEN_TASK = "state <> 'done'"  # a task not done yet: queued, or leased (perhaps with its lease run out)


class TaskRow(SQLModel, table=True):
    """A rollout task: one prompt to be answered `numGenerations` times and scored.

    Leased to one rollout worker at a time; a lease that expires makes the task claimable again, so a
    dead worker loses nothing, and a worker whose row ends (end_worker, report_exit) has its leased
    tasks queued again at once. `lease_token` grows with each lease: a completion carrying an older
    token is refused (a zombie's late result never overwrites a newer one).
    """

    __tablename__ = "tasks"
    __table_args__ = (
        UniqueConstraint("run", "step", "slot", name="uq_tasks_run_step_slot"),
        Index("ix_tasks_claim", "run", "state", "step"),
        # The tasks a lease can take, in claim order (migration 0007 says why).
        Index(
            "ix_tasks_open",
            "run",
            "step",
            "slot",
            postgresql_where=text(OPEN_TASK),
            sqlite_where=text(OPEN_TASK),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    run: str
    step: int = Field(description="the optimizer step whose batch this prompt belongs to")
    slot: int = Field(description="position of the prompt within that step's batch")
    min_weight_version: int = Field(description="generate with weights of at least this version")
    payload: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    state: str = Field(default="queued", description="queued | leased | done")
    lease_holder: str | None = None
    lease_token: int = 0
    lease_expires_at: datetime | None = _time(False)
    attempts: int = 0
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_at: datetime = _time()
    done_at: datetime | None = _time(False)


def table_of(model: type[SQLModel]) -> Table:
    """The Core table of a row class, for statements built once (SQLModel sets `__table__` on each table
    class when it is created; its type stubs do not declare it)."""
    return model.__table__  # type: ignore[attr-defined]
