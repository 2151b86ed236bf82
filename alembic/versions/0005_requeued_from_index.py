"""An index on outbox_message.requeued_from, for requeue checks and purge.

Revision ID: outbox_0005
Revises: outbox_0004
Create Date: 2026-12-03

Every delete of an outbox_message row makes PostgreSQL check the foreign key
``requeued_from`` (is a copy still pointing at this row?), and purge and
requeue ask the same question themselves. Without an index each check scans
the table, so purging a big table took one scan per deleted row. The index is
partial: only requeued copies have the column set, so it stays tiny.

The build reads the whole table once while holding a lock that blocks writes
(emits) for that time. On a big, busy table create it beforehand without that
lock; the migration then finds it and skips it::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_outbox_message_requeued_from
        ON outbox_message (requeued_from) WHERE requeued_from IS NOT NULL;
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0005"
down_revision = "outbox_0004"
branch_labels = None
depends_on = None

_REQUEUED = sa.text("requeued_from IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_outbox_message_requeued_from",
        "outbox_message",
        ["requeued_from"],
        postgresql_where=_REQUEUED,
        sqlite_where=_REQUEUED,
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_message_requeued_from", table_name="outbox_message", if_exists=True)
