"""checkpoints.provenance, weights.provenance: what made each checkpoint and weight version.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

Self-contained, as 0001: plain SQLAlchemy types, no imports from mortal. Rows written before it have
no provenance (NULL): a resume from such a checkpoint checks the files it can (step, optimizer,
scheduler) and says the rest could not be verified.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("checkpoints", "weights"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("provenance", sa.JSON(), nullable=True))


def downgrade() -> None:
    for table in ("weights", "checkpoints"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("provenance")
