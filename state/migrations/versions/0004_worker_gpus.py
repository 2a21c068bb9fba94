"""workers.gpus: the GPUs each worker holds, for its GPU time (spec.limits.maxGPUHours).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

Self-contained, as 0001: plain SQLAlchemy types, no imports from mortal. Rows written before it hold
0 GPUs (their GPU time is not known; CPU runs are right, GPU runs' earlier workers count nothing).
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("gpus", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("gpus")
