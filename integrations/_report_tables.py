"""Tables that track report runs: what a UI reads to show progress.

Kept on their own MetaData (with the outbox naming convention) because
``outbox`` must not know about its integrations; the ``outbox`` Alembic branch
creates them.
"""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    CheckConstraint,
    Column,
    ForeignKey,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    literal_column,
)

from outbox._tables import NAMING_CONVENTION
from outbox._types import JSONDocument, RowId, UTCDateTime

__all__ = ["RUN_STATUSES", "report_metadata", "outbox_report_chunk", "outbox_report_run"]

RUN_STATUSES: Final = ("running", "assembling", "complete", "failed")

report_metadata = MetaData(naming_convention=NAMING_CONVENTION)

outbox_report_run = Table(
    "outbox_report_run",
    report_metadata,
    Column("id", String(32), primary_key=True),
    Column("report", String(255), nullable=False),
    Column("params", JSONDocument, nullable=False),
    Column("status", String(16), nullable=False, server_default=literal_column("'running'")),
    Column("total_chunks", Integer, nullable=False),
    Column("done_chunks", Integer, nullable=False, server_default=literal_column("0")),
    Column("row_count", Integer, nullable=False, server_default=literal_column("0")),
    Column("created_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime),
    Column("location", Text),
    # The chunk message (an outbox_message.id, so a bigint) that won the right to
    # assemble; its own retries may redo it. Integer before migration outbox_0004.
    Column("assembled_by", RowId),
    Column("error", Text),
    CheckConstraint("status IN ('running', 'assembling', 'complete', 'failed')", name="status"),
    CheckConstraint("done_chunks <= total_chunks", name="progress"),
)

outbox_report_chunk = Table(
    "outbox_report_chunk",
    report_metadata,
    Column("run_id", String(32), ForeignKey("outbox_report_run.id", ondelete="CASCADE"), nullable=False),
    Column("chunk", Integer, nullable=False),
    Column("row_count", Integer, nullable=False),
    Column("finished_at", UTCDateTime, nullable=False),
    PrimaryKeyConstraint("run_id", "chunk"),
)
