"""completions: the sampled completions of each step (prompt, completion, rewards, advantage, ...).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Self-contained, as 0001: plain SQLAlchemy types, no imports from mortal.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "completions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("run", sa.String(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("sample", sa.Integer(), nullable=False),
        sa.Column("prompt", sa.String(), nullable=False),
        sa.Column("completion", sa.String(), nullable=False),
        sa.Column("rewards", sa.JSON(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("advantage", sa.Float(), nullable=True),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column("extra", sa.JSON(), nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("run", "step", "sample", name="uq_completions_run_step_sample"),
    )


def downgrade() -> None:
    op.drop_table("completions")
