"""tasks: a partial index over the tasks not done yet, in claim order (run, step, slot).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24

Why: a lease takes the oldest claimable task of a run. Done tasks stay in the table (their results are
the step's batch), so with only the (run, step, slot) key the claim walked past every done task of the
run: a cost that grew with the run's age. The partial index holds only queued and leased tasks, so a
claim reads the first few entries, however many steps the run has done. PostgreSQL and SQLite both
build partial indexes; the claim's WHERE carries the same `state <> 'done'` term, so both planners use it.
Self-contained, as 0001: plain SQLAlchemy, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

OPEN = sa.text("state <> 'done'")


def upgrade() -> None:
    op.create_index("ix_tasks_open", "tasks", ["run", "step", "slot"], postgresql_where=OPEN, sqlite_where=OPEN)


def downgrade() -> None:
    op.drop_index("ix_tasks_open", table_name="tasks")
