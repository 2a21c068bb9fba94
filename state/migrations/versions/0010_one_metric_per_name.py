"""metrics: one row per (run, step, name), held by a unique index.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

Why: add_metrics replaced a step's values by deleting the rows it found and inserting new ones. Two
writers of the same step at once could both insert (each deleting only what it saw), leaving two values
for a name, and could deadlock on the rows they deleted in opposite orders (one failed). With the index,
add_metrics is one upsert (INSERT ... ON CONFLICT (run, step, name) DO UPDATE) taking the rows in name
order. Duplicates already stored are reduced to their latest row (the highest id) first.
Self-contained, as 0001: plain SQLAlchemy, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        sa.text(
            "DELETE FROM metrics WHERE id NOT IN (SELECT max(id) FROM metrics GROUP BY run, step, name)"
        )
    )
    op.create_index("uq_metrics_run_step_name", "metrics", ["run", "step", "name"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_metrics_run_step_name", table_name="metrics")
