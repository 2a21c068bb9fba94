"""workers.activity, workers.activity_since: what a worker is doing and since when (its heartbeat says).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

Why: a worker whose process is alive and heartbeats, but whose task, step, weight load or collective
never ends, looked healthy. The controller compares activity_since with the activity's deadline
(mortal.controller.deadlines) and relaunches the worker past it. Rows written before it hold no activity.
Self-contained, as 0001: plain SQLAlchemy types, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("activity", sa.String(), nullable=True))
        batch.add_column(sa.Column("activity_since", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("activity_since")
        batch.drop_column("activity")
