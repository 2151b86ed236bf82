"""The relay registry: ``outbox_relay_registry``, one row per relay id, written by the relay itself.

Revision ID: outbox_0011
Revises: outbox_0010
Create Date: 2026-12-09

Which relays are alive, where they run, what they hold and which of their
destinations are cut off by a circuit breaker lived only in each relay's
memory; an operator (or a dashboard) had to scrape every relay's metrics to
answer "is anyone delivering?". Each relay now upserts its row when it starts,
refreshes ``seen_at``, ``in_flight`` and ``handlers`` every few seconds, and
sets ``stopped_at`` when it stops cleanly. Rows are never deleted by relays: a
relay that crashed stays on record, and its ``seen_at`` tells since when.

The table is new: nothing is rewritten, no lock is taken on a busy table. A
relay of this version on a database not migrated this far keeps delivering
and logs that it cannot write its row.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0011"
down_revision = "outbox_0010"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "outbox_relay_registry",
        sa.Column("relay_id", sa.String(255), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("seen_at", _TS, nullable=False),
        sa.Column("stopped_at", _TS),
        sa.Column("queues", _JSON, nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("handlers", _JSON, nullable=False),
        sa.PrimaryKeyConstraint("relay_id", name="pk_outbox_relay_registry"),
    )


def downgrade() -> None:
    # Nothing is lost that the relays do not write again within seconds of an upgrade.
    op.drop_table("outbox_relay_registry")
