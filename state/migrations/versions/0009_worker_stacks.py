"""workers.stacks_asked_at, workers.stacks_written_at: the controller's request for a stalled worker's stacks,
and the worker's answer.

Revision ID: 0009
Revises: 0008

Why: before it relaunches a worker that ran past the deadline of its activity, the controller wants the
worker's Python stacks in its log. The local backend signals the process (SIGUSR1), but a Modal container
cannot be signalled from outside. The request now goes through the store, which every worker already
calls every heartbeat: the controller sets stacks_asked_at, the worker's heartbeat reads it back, writes
its stacks and reports stacks_written_at. Rows written before it were never asked.
Self-contained, as 0001: plain SQLAlchemy types, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("stacks_asked_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("stacks_written_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("stacks_written_at")
        batch.drop_column("stacks_asked_at")
