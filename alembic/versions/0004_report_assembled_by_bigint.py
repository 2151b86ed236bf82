"""outbox_report_run.assembled_by as a bigint, like the outbox_message.id it holds.

Revision ID: outbox_0004
Revises: outbox_0003
Create Date: 2026-12-03

Only PostgreSQL changes: on SQLite every INTEGER column already stores 64-bit
values, and ``outbox_message.id`` is INTEGER there too (the rowid alias), so the
declared type stays as it is and no table has to be rebuilt.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0004"
down_revision = "outbox_0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.alter_column(
            "outbox_report_run", "assembled_by", type_=sa.BigInteger(), existing_type=sa.Integer()
        )


def downgrade() -> None:
    # Fails if a stored message id no longer fits in 32 bits: better than truncating it.
    if op.get_context().dialect.name == "postgresql":
        op.alter_column(
            "outbox_report_run", "assembled_by", type_=sa.Integer(), existing_type=sa.BigInteger()
        )
