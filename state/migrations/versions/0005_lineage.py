"""runs.forked_from, runs.forked_from_step: a forked run's parent and the checkpoint step it started from.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("forked_from", sa.String(), nullable=True))
        batch.add_column(sa.Column("forked_from_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("forked_from_step")
        batch.drop_column("forked_from")
