"""The first schema: runs, workers, checkpoints, weights, events, metrics, leases, tasks.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Self-contained on purpose (plain SQLAlchemy types, no imports from mortal): a migration describes
the schema as it was when written, whatever the models say later.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TIME = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), primary_key=True)


def _run() -> sa.Column:
    return sa.Column("run", sa.String(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("name", sa.String(), primary_key=True),
        sa.Column("uid", sa.String(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("resource_version", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(), nullable=False),
        sa.Column("status", sa.JSON(), nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
        sa.Column("updated_at", _TIME, nullable=False),
        sa.Column("deleted_at", _TIME, nullable=True),
        sa.Column("purge_requested", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_runs_phase", "runs", ["phase"])

    op.create_table(
        "workers",
        _id(),
        _run(),
        sa.Column("role", sa.String(), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=False),
        sa.Column("incarnation", sa.Integer(), nullable=False),
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("handle", sa.String(), nullable=True),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("heartbeat_at", _TIME, nullable=True),
        sa.Column("lease_seconds", sa.Float(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("weight_version", sa.Integer(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("message", sa.String(), nullable=True),
        sa.Column("started_at", _TIME, nullable=False),
        sa.Column("ended_at", _TIME, nullable=True),
        sa.UniqueConstraint("run", "role", "replica", "incarnation", name="uq_workers_slot_incarnation"),
    )
    op.create_index("ix_workers_run", "workers", ["run"])

    op.create_table(
        "checkpoints",
        _id(),
        _run(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column("complete", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
        sa.UniqueConstraint("run", "step", name="uq_checkpoints_run_step"),
    )
    op.create_index("ix_checkpoints_run", "checkpoints", ["run"])

    op.create_table(
        "weights",
        sa.Column("run", sa.String(), primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("method", sa.String(), nullable=False),
        sa.Column("created_at", _TIME, nullable=False),
    )

    op.create_table(
        "events",
        _id(),
        _run(),
        sa.Column("type", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("time", _TIME, nullable=False),
    )
    op.create_index("ix_events_run_time", "events", ["run", "time"])

    op.create_table(
        "metrics",
        _id(),
        _run(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("time", _TIME, nullable=False),
    )
    op.create_index("ix_metrics_run_name_step", "metrics", ["run", "name", "step"])

    op.create_table(
        "leases",
        sa.Column("name", sa.String(), primary_key=True),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("token", sa.Integer(), nullable=False),
        sa.Column("expires_at", _TIME, nullable=False),
        sa.Column("renewed_at", _TIME, nullable=False),
    )

    op.create_table(
        "tasks",
        _id(),
        _run(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("min_weight_version", sa.Integer(), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("lease_holder", sa.String(), nullable=True),
        sa.Column("lease_token", sa.Integer(), nullable=False),
        sa.Column("lease_expires_at", _TIME, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("created_at", _TIME, nullable=False),
        sa.Column("done_at", _TIME, nullable=True),
        sa.UniqueConstraint("run", "step", "slot", name="uq_tasks_run_step_slot"),
    )
    op.create_index("ix_tasks_claim", "tasks", ["run", "state", "step"])


def downgrade() -> None:
    for table in ("tasks", "leases", "metrics", "events", "weights", "checkpoints", "workers", "runs"):
        op.drop_table(table)
