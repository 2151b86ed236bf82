"""Report runs and their chunks (outbox.integrations.report); the retention log.

Revision ID: outbox_0002
Revises: outbox_0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0002"
down_revision = "outbox_0001"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "outbox_report_run",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("report", sa.String(255), nullable=False),
        sa.Column("params", _JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default=sa.literal_column("'running'")),
        sa.Column("total_chunks", sa.Integer, nullable=False),
        sa.Column("done_chunks", sa.Integer, nullable=False, server_default=sa.literal_column("0")),
        sa.Column("row_count", sa.Integer, nullable=False, server_default=sa.literal_column("0")),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("finished_at", _TS),
        sa.Column("location", sa.Text),
        sa.Column("assembled_by", sa.Integer),
        sa.Column("error", sa.Text),
        sa.CheckConstraint(
            "status IN ('running', 'assembling', 'complete', 'failed')",
            name=op.f("ck_outbox_report_run_status"),
        ),
        sa.CheckConstraint("done_chunks <= total_chunks", name=op.f("ck_outbox_report_run_progress")),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_report_run"),
    )
    op.create_table(
        "outbox_report_chunk",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("chunk", sa.Integer, nullable=False),
        sa.Column("row_count", sa.Integer, nullable=False),
        sa.Column("finished_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["outbox_report_run.id"],
            ondelete="CASCADE",
            name="fk_outbox_report_chunk_run_id_outbox_report_run",
        ),
        sa.PrimaryKeyConstraint("run_id", "chunk", name="pk_outbox_report_chunk"),
    )
    op.create_table(
        "outbox_retention_run",
        sa.Column("id", _ID, sa.Identity(), nullable=False),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("finished_at", _TS),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("delivered_before", _TS, nullable=False),
        sa.Column("history_before", _TS),
        sa.Column("messages_deleted", sa.Integer, nullable=False, server_default=sa.literal_column("0")),
        sa.Column("attempts_deleted", sa.Integer, nullable=False, server_default=sa.literal_column("0")),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_retention_run"),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("outbox_retention_run")
    op.drop_table("outbox_report_chunk")
    op.drop_table("outbox_report_run")
