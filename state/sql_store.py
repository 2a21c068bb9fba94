"""SqlStore: the Store contract on SQLAlchemy/SQLModel, for SQLite and PostgreSQL.

Created by `mortal.state.open_store` (which also migrates); used by the CLI, the controller and the
workers through the `Store` interface only. It is the only code that writes SQL. It must not decide
anything: it enforces the invariants of mortal.state.store and nothing else.

Every method is one transaction: `_tx` (an ORM Session) or, in the calls every worker makes all the
time (heartbeat, the task lease calls, add_metrics, get_run, run_uid, latest_weights), `_conn` (a Connection
running Core statements built once): the ORM's per-call Python was most of such a call's cost. A call
whose database connection broke before anything was committed (ConnectionLost) is made again once.
Writes to a run row are guarded UPDATEs (`... WHERE resource_version = :v`, row count checked);
worker writes first check the worker's fencing token, controller writes the leader's lease, in the
same transaction (mortal.state.fencing). The rollout task queue lives in mortal.state.task_queue, the
sampled completions in mortal.state.completions.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, delete, func, update
from sqlalchemy import select as core_select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DataError, IntegrityError
from sqlmodel import Session, SQLModel, col, select

from mortal.state import migrate, paths
from mortal.state.completions import CompletionLog
from mortal.state.engine import (
    connection,
    is_postgres,
    json_value,
    make_engine,
    open_connections,
    transaction,
)
from mortal.state.errors import ChangeRefused, Conflict, ConnectionLost, InvalidValue, NotFound
from mortal.state.fencing import CHECK_STATEMENTS, TERMINAL_WORKER_STATES, check_leader, check_worker
from mortal.state.names import check_metadata, check_role, check_run_name
from mortal.state.spec_changes import refused_change
from mortal.state.store import ApplyOutcome, LeaderFence, Store, WorkerRef, activity_age, check_activity
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
    as_utc,
    table_of,
    utcnow,
)
from mortal.state.task_queue import LEASE_STATEMENTS, TaskQueue, rowcount

_RUN_OWNED = (WorkerRow, CheckpointRow, WeightRow, EventRow, MetricRow, TaskRow, CompletionRow)
_RUNS, _WORKERS = table_of(RunRow), table_of(WorkerRow)
_WEIGHTS, _METRICS = table_of(WeightRow), table_of(MetricRow)
# The hot calls' statements, built once (mortal.state.task_queue has the task queue's).
_GET_RUN = core_select(_RUNS).where(_RUNS.c.name == bindparam("b_name"))
_RUN_UID = core_select(_RUNS.c.uid).where(_RUNS.c.name == bindparam("b_name"))
_LATEST_WEIGHTS = (
    core_select(_WEIGHTS)
    .where(_WEIGHTS.c.run == bindparam("b_run"))
    .order_by(_WEIGHTS.c.version.desc())
    .limit(1)
)
_HEARTBEAT = (
    update(_WORKERS)
    .where(_WORKERS.c.id == bindparam("b_id"))
    .values(
        heartbeat_at=bindparam("b_now"),
        activity=bindparam("b_activity"),
        activity_since=bindparam("b_activity_since"),
        state="Running",
        step=func.coalesce(bindparam("b_step", type_=_WORKERS.c.step.type), _WORKERS.c.step),
        weight_version=func.coalesce(
            bindparam("b_weight_version", type_=_WORKERS.c.weight_version.type), _WORKERS.c.weight_version
        ),
    )
    .returning(*_WORKERS.c)
)
_REPORT_EXIT = (
    update(_WORKERS)
    .where(_WORKERS.c.id == bindparam("b_id"))
    .values(
        state=bindparam("b_state"),
        exit_code=bindparam("b_exit_code"),
        message=bindparam("b_message"),
        ended_at=bindparam("b_now"),
    )
    .returning(*_WORKERS.c)
)


def _set_metrics(insert_of: Callable[[Any], Any]) -> Any:
    """INSERT ... ON CONFLICT (run, step, name) DO UPDATE: a name's value for a step, new or replaced."""
    statement = insert_of(_METRICS)
    return statement.on_conflict_do_update(
        index_elements=["run", "step", "name"],
        set_={"value": statement.excluded.value, "time": statement.excluded.time},
    )


_SET_METRICS = {"postgresql": _set_metrics(pg_insert), "sqlite": _set_metrics(sqlite_insert)}
# What the calls every worker makes all the time run (add_metrics's upsert aside: it cannot match no row).
_HOT_STATEMENTS = (*CHECK_STATEMENTS, *LEASE_STATEMENTS, _HEARTBEAT, _GET_RUN, _LATEST_WEIGHTS)


def _run_hot_statements(conn: Connection) -> None:
    """Each hot statement once on `conn`, every parameter None, so that it matches no row (the caller
    rolls back). Why: a server's first calls otherwise each compiled their statements (SQLAlchemy's cache,
    per engine, keyed also by the parameters' names: these are the calls' own) and had PostgreSQL's new
    session plan them first, loading its catalog caches, all in the first second of clients connecting."""
    for statement in _HOT_STATEMENTS:
        binds = statement.compile(dialect=conn.dialect).binds
        conn.execute(statement, {name: None for name, bind in binds.items() if bind.required})


_STORE_CALLS_TRIED_TWICE = Store.__abstractmethods__ - {"close", "migrate"}


def _once_more_if_the_connection_broke(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` made again, once, when it raised ConnectionLost: its transaction was never committed."""

    @functools.wraps(method)
    def call(self: SqlStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except ConnectionLost:
            return method(self, *args, **kwargs)

    return call


def _calls_tried_twice(cls: type[SqlStore]) -> type[SqlStore]:
    """Every Store call of `cls` made again once when the database connection broke under it (a server
    restart, a backend terminated, a pooled connection that died idle): each call is one transaction,
    and ConnectionLost says it was not committed, so making it again cannot apply it twice."""
    for name in _STORE_CALLS_TRIED_TWICE:
        setattr(cls, name, _once_more_if_the_connection_broke(getattr(cls, name)))
    return cls


def _check_version(row: RunRow, resource_version: int | None) -> None:
    """The caller's precondition on a run row (None: none): Conflict when the row moved past it."""
    if resource_version is not None and row.resource_version != resource_version:
        raise Conflict(
            f"trainingrun {row.name!r} is at resource_version {row.resource_version}, not {resource_version}"
        )


def _json(value: Any) -> Any:
    """The value as JSON will store it (tuples -> lists, ...), so equality means 'stores the same'."""
    return json_value(value)


@_calls_tried_twice
class SqlStore(TaskQueue, CompletionLog, Store):
    """The store on one database URL (sqlite:///..., postgresql://...). Connects on first use."""

    def __init__(self, url: str, pool_size: int | None = None) -> None:
        """`pool_size`: database connections kept open (engine.make_engine says why a server sets it)."""
        self.url = url
        self._engine = make_engine(url, pool_size)

    def __repr__(self) -> str:
        return f"SqlStore({paths.shown_url(self.url)!r})"

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Session]:
        """One transaction in an ORM Session; errors as `_refusals` says."""
        with _refusals(), transaction(self._engine, write) as session:
            yield session

    @contextmanager
    def _conn(self, write: bool = True, one_read: bool = False) -> Iterator[Connection]:
        """One transaction on a Connection, for Core statements (the hot calls); errors as `_refusals`.
        `one_read`: the block runs one SELECT (engine.connection says what that saves)."""
        with _refusals(), connection(self._engine, write, one_read) as conn:
            yield conn

    def _insert_ignore(self, session: Session, model: type[SQLModel], values: dict[str, Any]) -> bool:
        """INSERT ... ON CONFLICT DO NOTHING; True if the row was new."""
        insert = pg_insert if is_postgres(self._engine) else sqlite_insert
        # Every table model has a __table__; SQLModel's type does not say so.
        table = model.__table__  # type: ignore[attr-defined]
        statement = insert(table).values(**values).on_conflict_do_nothing().returning(*table.primary_key)
        return session.execute(statement).first() is not None

    # -- lifecycle -------------------------------------------------------------------------
    def migrate(self) -> None:
        migrate.upgrade(self._engine)

    def open_connections(self, count: int) -> None:
        """Open `count` database connections now, kept in the pool (up to its size) for the next calls,
        each having run the hot calls' statements once (`_run_hot_statements`)."""
        open_connections(self._engine, count, _run_hot_statements)

    def close(self) -> None:
        self._engine.dispose()

    # -- runs ------------------------------------------------------------------------------
    def _run(self, session: Session, name: str, lock: bool = False) -> RunRow:
        query = select(RunRow).where(RunRow.name == name)
        row = session.exec(query.with_for_update() if lock else query).first()
        if row is None:
            raise NotFound(f"trainingrun {name!r} not found")
        return row

    def _update_run(self, session: Session, row: RunRow, **values: Any) -> RunRow:
        """The guarded write of a run row: applies only if resource_version is still row's."""
        result = session.execute(
            update(RunRow)
            .where(col(RunRow.name) == row.name, col(RunRow.resource_version) == row.resource_version)
            .values(resource_version=row.resource_version + 1, updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False)
        )
        if rowcount(result) != 1:
            raise Conflict(f"trainingrun {row.name!r} changed since resource_version {row.resource_version}")
        written = session.get(RunRow, row.name, populate_existing=True)
        if written is None:
            raise NotFound(f"trainingrun {row.name!r} not found")
        return written

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
        check_run_name(name)
        check_metadata(labels or {}, annotations or {})
        spec, labels, annotations = _json(spec), _json(labels or {}), _json(annotations or {})
        applied = _json(applied) if applied is not None else None
        try:
            with self._tx() as s:
                decided = self._apply_run(s, name, spec, labels, annotations, applied, resource_version)
                if dry_run:  # a copy: rolling back expires the session's instances
                    row, outcome = decided
                    raise _RolledBack((RunRow(**row.model_dump()), outcome))
                return decided
        except _RolledBack as dry:
            return dry.decided

    def _apply_run(
        self,
        s: Session,
        name: str,
        spec: dict[str, Any],
        labels: dict[str, str],
        annotations: dict[str, str],
        applied: dict[str, Any] | None,
        resource_version: int | None,
    ) -> tuple[RunRow, ApplyOutcome]:
        """apply_run's decision and writes inside its transaction."""
        new = RunRow(
            name=name,
            uid=str(uuid.uuid4()),
            spec=spec,
            labels=labels,
            annotations=annotations,
            applied=applied,
        )
        if self._insert_ignore(s, RunRow, new.model_dump()):
            return self._run(s, name), ApplyOutcome.created
        row = self._run(s, name, lock=True)
        if row.deleted_at is not None:
            raise Conflict(f"trainingrun {name!r} is being deleted")
        _check_version(row, resource_version)
        if (row.spec, row.labels, row.annotations) == (spec, labels, annotations):
            if row.applied is None and applied is not None:  # a fork's first apply: record its fields
                row = self._update_run(s, row, applied=applied)
            return row, ApplyOutcome.unchanged
        if (refusal := refused_change(row, spec)) is not None:
            raise ChangeRefused(refusal)
        row = self._update_run(
            s,
            row,
            spec=spec,
            labels=labels,
            annotations=annotations,
            applied=applied,
            generation=row.generation + (row.spec != spec),
        )
        return row, ApplyOutcome.configured

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
        check_run_name(name)
        check_metadata(labels or {}, annotations or {})
        spec, labels, annotations = _json(spec), _json(labels or {}), _json(annotations or {})
        with self._tx() as s:
            new = RunRow(
                name=name,
                uid=str(uuid.uuid4()),
                spec=spec,
                labels=labels,
                annotations=annotations,
                forked_from=parent,
                forked_from_step=parent_step,
            )
            if not self._insert_ignore(s, RunRow, new.model_dump()):
                raise Conflict(f"trainingrun {name!r} already exists")
            s.add(
                CheckpointRow(
                    run=name,
                    step=parent_step,
                    path=checkpoint_path,
                    weight_version=weight_version,
                    complete=True,
                    provenance=_json(provenance) if provenance is not None else None,
                )
            )
            s.flush()
            return self._run(s, name)

    def rollback_run(self, name: str, step: int) -> list[CheckpointRow]:
        with self._tx() as s:
            row = self._run(s, name, lock=True)
            if row.deleted_at is not None:
                raise Conflict(f"trainingrun {name!r} is being deleted")
            live = s.exec(
                select(WorkerRow).where(
                    WorkerRow.run == name, col(WorkerRow.state).not_in(TERMINAL_WORKER_STATES)
                )
            ).all()
            if live:
                listed = ", ".join(f"{w.role}-{w.replica} #{w.incarnation} ({w.state})" for w in live)
                raise Conflict(f"trainingrun {name!r} still has live workers: {listed}; suspend it first")
            target = s.exec(
                select(CheckpointRow).where(
                    CheckpointRow.run == name, CheckpointRow.step == step, CheckpointRow.complete
                )
            ).first()
            if target is None:
                raise NotFound(f"trainingrun {name!r} has no complete checkpoint of step {step}")
            later = list(
                s.exec(
                    select(CheckpointRow)
                    .where(CheckpointRow.run == name, CheckpointRow.step > step)
                    .order_by(col(CheckpointRow.step))
                ).all()
            )
            for model in (CheckpointRow, MetricRow, CompletionRow, TaskRow):
                s.execute(delete(model).where(col(model.run) == name, col(model.step) > step))
            s.execute(
                update(WorkerRow)
                .where(col(WorkerRow.run) == name, col(WorkerRow.step) > step)
                .values(step=step)
                .execution_options(synchronize_session=False)
            )
            return later

    def get_run(self, name: str) -> RunRow:
        with self._conn(write=False, one_read=True) as c:
            row = c.execute(_GET_RUN, {"b_name": name}).mappings().first()
        if row is None:
            raise NotFound(f"trainingrun {name!r} not found")
        return RunRow.model_validate(dict(row))

    def run_uid(self, name: str) -> str | None:
        with self._conn(write=False) as c:
            return c.execute(_RUN_UID, {"b_name": name}).scalar()

    def list_runs(self, labels: dict[str, str] | None = None, include_deleted: bool = True) -> list[RunRow]:
        with self._tx(write=False) as s:
            rows = s.exec(select(RunRow).order_by(RunRow.name)).all()
        wanted = (labels or {}).items()
        return [r for r in rows if wanted <= r.labels.items() and (include_deleted or r.deleted_at is None)]

    def update_spec(self, name: str, spec: dict[str, Any], resource_version: int) -> RunRow:
        spec = _json(spec)
        with self._tx() as s:
            row = self._run(s, name)
            _check_version(row, resource_version)
            if row.deleted_at is not None:
                raise Conflict(f"trainingrun {name!r} is being deleted")
            if (refusal := refused_change(row, spec)) is not None:
                raise ChangeRefused(refusal)
            return self._update_run(s, row, spec=spec, generation=row.generation + (row.spec != spec))

    def write_status(
        self,
        name: str,
        status: dict[str, Any],
        resource_version: int | None = None,
        fence: LeaderFence | None = None,
        events: Sequence[tuple[str, str, str]] = (),
    ) -> RunRow:
        status = _json(status)
        with self._tx() as s:
            check_leader(s, fence)
            row = self._run(s, name, lock=True)
            _check_version(row, resource_version)
            for type_, reason, message in events:
                s.add(EventRow(run=name, type=type_, reason=reason, message=message))
            return self._update_run(s, row, status=status, phase=status.get("phase", row.phase))

    def mark_deleted(self, name: str, purge: bool = False) -> RunRow:
        with self._tx() as s:
            row = self._run(s, name, lock=True)
            if row.deleted_at is not None and (row.purge_requested or not purge):
                return row
            return self._update_run(
                s, row, deleted_at=row.deleted_at or utcnow(), purge_requested=row.purge_requested or purge
            )

    def purge_run(self, name: str, fence: LeaderFence | None = None) -> None:
        with self._tx() as s:
            check_leader(s, fence)
            self._run(s, name, lock=True)
            for model in _RUN_OWNED:
                s.execute(delete(model).where(col(model.run) == name))
            s.execute(delete(RunRow).where(col(RunRow.name) == name))

    # -- workers ---------------------------------------------------------------------------
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
        check_role(role)
        with self._tx() as s:
            check_leader(s, fence)
            if self._run(s, run, lock=True).deleted_at is not None:  # the lock serializes incarnations
                raise Conflict(f"trainingrun {run!r} is being deleted")
            # Wait out any write the slot's current incarnation has in flight: its fence check holds a
            # share lock on that row until commit, so once this lock is granted no write of the old
            # incarnation can land after the new one exists.
            s.exec(
                select(WorkerRow.id)
                .where(WorkerRow.run == run, WorkerRow.role == role, WorkerRow.replica == replica)
                .order_by(col(WorkerRow.incarnation).desc())
                .limit(1)
                .with_for_update()
            ).first()
            newest = s.exec(select(func.max(WorkerRow.incarnation)).where(WorkerRow.run == run)).one()
            row = WorkerRow(
                run=run,
                role=role,
                replica=replica,
                incarnation=(newest or 0) + 1,
                backend=backend,
                lease_seconds=lease_seconds,
                gpus=gpus,
            )
            s.add(row)
            s.flush()
            return row

    def _worker(self, session: Session, worker_id: int) -> WorkerRow:
        row = session.get(WorkerRow, worker_id, with_for_update=True)
        if row is None:
            raise NotFound(f"worker {worker_id} not found")
        return row

    def set_worker_handle(self, worker_id: int, handle: str, fence: LeaderFence | None = None) -> WorkerRow:
        with self._tx() as s:
            check_leader(s, fence)
            row = self._worker(s, worker_id)
            row.handle = handle
            s.flush()
            return row

    def end_worker(
        self,
        worker_id: int,
        state: str,
        exit_code: int | None = None,
        message: str | None = None,
        fence: LeaderFence | None = None,
    ) -> WorkerRow:
        if state not in TERMINAL_WORKER_STATES:
            raise ValueError(
                f"end_worker: state must be one of {sorted(TERMINAL_WORKER_STATES)}, not {state!r}"
            )
        with self._tx() as s:
            check_leader(s, fence)
            row = self._worker(s, worker_id)
            if row.state not in TERMINAL_WORKER_STATES:  # the first end wins: it says what happened
                row.state, row.exit_code, row.message, row.ended_at = state, exit_code, message, utcnow()
                s.flush()
            self._release_leases(s, WorkerRef(row.run, row.role, row.replica, row.incarnation))
            return row

    def list_workers(self, run: str | None = None, live_only: bool = False) -> list[WorkerRow]:
        query = select(WorkerRow).order_by(
            col(WorkerRow.run), col(WorkerRow.role), col(WorkerRow.replica), col(WorkerRow.incarnation)
        )
        if run is not None:
            query = query.where(WorkerRow.run == run)
        if live_only:
            query = query.where(col(WorkerRow.state).not_in(TERMINAL_WORKER_STATES))
        with self._tx(write=False) as s:
            return list(s.exec(query).all())

    def heartbeat(
        self,
        worker: WorkerRef,
        step: int | None = None,
        weight_version: int | None = None,
        activity: str | None = None,
        activity_seconds: float | None = None,
    ) -> WorkerRow:
        activity = check_activity(activity)
        with self._conn() as c:
            worker_id = check_worker(c, worker, for_update=True)
            now = utcnow()
            since = None if activity is None else now - timedelta(seconds=activity_age(activity_seconds))
            values = {
                "b_id": worker_id,
                "b_now": now,
                "b_activity": activity,
                "b_activity_since": since,
                "b_step": step,
                "b_weight_version": weight_version,
            }
            row = c.execute(_HEARTBEAT, values).mappings().one()
        return WorkerRow.model_validate(dict(row))

    def request_stacks(
        self, worker_id: int, written: bool = False, fence: LeaderFence | None = None
    ) -> WorkerRow:
        with self._tx() as s:
            check_leader(s, fence)
            row = self._worker(s, worker_id)
            if row.state not in TERMINAL_WORKER_STATES:
                now = utcnow()
                row.stacks_asked_at, row.stacks_written_at = now, now if written else None
                s.flush()
            return row

    def report_stacks(self, worker: WorkerRef) -> WorkerRow:
        with self._tx() as s:
            row = self._worker(s, check_worker(s, worker, for_update=True))
            if row.stacks_asked_at is not None and row.stacks_written_at is None:
                row.stacks_written_at = utcnow()
                s.flush()
            return row

    def report_exit(
        self, worker: WorkerRef, state: str, exit_code: int, message: str | None = None
    ) -> WorkerRow:
        if state not in ("Succeeded", "Failed"):
            raise ValueError(f"report_exit: state must be Succeeded or Failed, not {state!r}")
        with self._conn() as c:
            worker_id = check_worker(c, worker, for_update=True)
            values = {
                "b_id": worker_id,
                "b_state": state,
                "b_exit_code": exit_code,
                "b_message": message,
                "b_now": utcnow(),
            }
            row = c.execute(_REPORT_EXIT, values).mappings().one()
            self._release_leases(c, worker)
        return WorkerRow.model_validate(dict(row))

    # -- checkpoints, weights ----------------------------------------------------------------
    def record_checkpoint(
        self,
        worker: WorkerRef,
        step: int,
        path: str,
        weight_version: int,
        provenance: dict[str, Any] | None = None,
    ) -> CheckpointRow:
        with self._tx() as s:
            check_worker(s, worker)
            query = select(CheckpointRow).where(CheckpointRow.run == worker.run, CheckpointRow.step == step)
            row = s.exec(query.with_for_update()).first() or CheckpointRow(
                run=worker.run, step=step, path=path, weight_version=0
            )
            row.path, row.weight_version, row.complete, row.created_at = path, weight_version, True, utcnow()
            row.provenance = provenance
            s.add(row)
            s.flush()
            return row

    def list_checkpoints(self, run: str, complete_only: bool = True) -> list[CheckpointRow]:
        query = select(CheckpointRow).where(CheckpointRow.run == run).order_by(col(CheckpointRow.step))
        if complete_only:
            query = query.where(CheckpointRow.complete)
        with self._tx(write=False) as s:
            return list(s.exec(query).all())

    def latest_checkpoint(self, run: str) -> CheckpointRow | None:
        query = select(CheckpointRow).where(CheckpointRow.run == run, CheckpointRow.complete)
        with self._tx(write=False) as s:
            return s.exec(query.order_by(col(CheckpointRow.step).desc()).limit(1)).first()

    def delete_checkpoint(self, worker: WorkerRef, step: int) -> None:
        with self._tx() as s:
            check_worker(s, worker)
            s.execute(
                delete(CheckpointRow).where(
                    col(CheckpointRow.run) == worker.run, col(CheckpointRow.step) == step
                )
            )

    def publish_weights(
        self,
        worker: WorkerRef,
        version: int,
        step: int,
        path: str,
        method: str = "volume",
        provenance: dict[str, Any] | None = None,
    ) -> WeightRow:
        with self._tx() as s:
            check_worker(s, worker)
            newest = s.exec(select(func.max(WeightRow.version)).where(WeightRow.run == worker.run)).one()
            if newest is not None and version <= newest:
                raise Conflict(f"weight version {version} of {worker.run!r} is not newer than {newest}")
            row = WeightRow(
                run=worker.run, version=version, step=step, path=path, method=method, provenance=provenance
            )
            s.add(row)
            s.flush()
            return row

    def latest_weights(self, run: str) -> WeightRow | None:
        with self._conn(write=False, one_read=True) as c:
            row = c.execute(_LATEST_WEIGHTS, {"b_run": run}).mappings().first()
        return None if row is None else WeightRow.model_validate(dict(row))

    def list_weights(self, run: str) -> list[WeightRow]:
        with self._tx(write=False) as s:
            return list(
                s.exec(select(WeightRow).where(WeightRow.run == run).order_by(col(WeightRow.version))).all()
            )

    def delete_weights(self, worker: WorkerRef, version: int) -> None:
        with self._tx() as s:
            check_worker(s, worker)
            s.execute(
                delete(WeightRow).where(col(WeightRow.run) == worker.run, col(WeightRow.version) == version)
            )

    # -- events, metrics ---------------------------------------------------------------------
    def add_event(self, run: str, type: str, reason: str, message: str) -> EventRow:
        with self._tx() as s:
            row = EventRow(run=run, type=type, reason=reason, message=message)
            s.add(row)
            s.flush()
            return row

    def list_events(
        self, run: str | None = None, limit: int = 50, before_id: int | None = None
    ) -> list[EventRow]:
        query = select(EventRow).order_by(col(EventRow.time).desc(), col(EventRow.id).desc()).limit(limit)
        if run is not None:
            query = query.where(EventRow.run == run)
        if before_id is not None:
            query = query.where(col(EventRow.id) < before_id)
        with self._tx(write=False) as s:
            return list(reversed(s.exec(query).all()))

    def add_metrics(self, worker: WorkerRef, step: int, values: dict[str, float]) -> None:
        with self._conn() as c:
            check_worker(c, worker)
            now = utcnow()
            # A resumed run re-records a step: one value per name, replaced. In name order, so that two
            # writers of one step take its rows' locks in the same order (uq_metrics_run_step_name).
            rows = [
                {"run": worker.run, "step": step, "name": k, "value": float(v), "time": now}
                for k, v in sorted(values.items())
            ]
            if rows:
                c.execute(_SET_METRICS[c.dialect.name], rows)

    def list_metrics(
        self, run: str, name: str | None = None, since_step: int | None = None
    ) -> list[MetricRow]:
        query = (
            select(MetricRow).where(MetricRow.run == run).order_by(col(MetricRow.step), col(MetricRow.name))
        )
        if name is not None:
            query = query.where(MetricRow.name == name)
        if since_step is not None:
            query = query.where(MetricRow.step >= since_step)
        with self._tx(write=False) as s:
            return list(s.exec(query).all())

    # -- leases ------------------------------------------------------------------------------
    def acquire_lease(
        self, name: str, holder: str, duration_seconds: float, now: datetime | None = None
    ) -> LeaseRow | None:
        now = as_utc(now) if now else utcnow()
        expires = now + timedelta(seconds=duration_seconds)
        with self._tx() as s:
            fresh = LeaseRow(name=name, holder=holder, token=1, expires_at=expires, renewed_at=now)
            if self._insert_ignore(s, LeaseRow, fresh.model_dump()):
                return s.get(LeaseRow, name)
            lease = s.get(LeaseRow, name, with_for_update=True)
            if lease is None:  # the insert found the row a moment ago, and leases are never deleted
                raise Conflict(f"lease {name!r} vanished while being acquired")
            if lease.holder != holder:
                if lease.expires_at > now:
                    return None
                lease.holder, lease.token = holder, lease.token + 1  # a takeover: a new fencing token
            lease.expires_at, lease.renewed_at = expires, now
            s.flush()
            return lease

    def release_lease(self, name: str, holder: str) -> None:
        """Expire the lease now (the row stays, so the next holder's token is still larger)."""
        with self._tx() as s:
            s.execute(
                update(LeaseRow)
                .where(col(LeaseRow.name) == name, col(LeaseRow.holder) == holder)
                .values(expires_at=utcnow())
                .execution_options(synchronize_session=False)
            )

    def get_lease(self, name: str) -> LeaseRow | None:
        with self._tx(write=False) as s:
            return s.get(LeaseRow, name)


class _RolledBack(Exception):  # noqa: N818 (not an error: how a dry run leaves its transaction)
    """Raised inside a transaction to roll it back, carrying what the call decided (apply_run's dry run)."""

    def __init__(self, decided: tuple[RunRow, ApplyOutcome]) -> None:
        super().__init__("dry run: rolled back")
        self.decided = decided


@contextmanager
def _refusals() -> Iterator[None]:
    """The database's refusals as the store's errors: a unique-key race is a Conflict (someone else wrote
    first), a value the database cannot hold is InvalidValue."""
    try:
        yield
    except IntegrityError as err:
        raise Conflict(f"concurrent write: {err.orig}") from err
    except DataError as err:  # e.g. PostgreSQL's "text fields cannot contain NUL": bad input, not a failure
        raise InvalidValue(f"the database refused a value: {err.orig}") from err
