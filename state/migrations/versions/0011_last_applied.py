"""runs.applied: the fields the run's last apply set (kubectl's last-applied-configuration).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07

Why: apply replaced the whole spec, so re-applying a file undid a scale or a suspend whenever the file
left the field out (it was written with its default). With the fields the previous document set, apply
merges three ways (mortal.specs.three_way_merge). Runs stored before have none (NULL): their next apply
keeps every field the file leaves out, as kubectl does for an object created without the annotation.
Self-contained, as 0001: plain SQLAlchemy, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("applied", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("applied")
