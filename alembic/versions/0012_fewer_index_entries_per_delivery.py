"""Fewer index entries per delivery: two indexes become partial, the lease index goes.

Revision ID: outbox_0012
Revises: outbox_0011
Create Date: 2026-12-10

A message's status changes twice on its way to ``delivered`` (claimed, then
finished). Because the status is in indexes and partial-index predicates,
PostgreSQL cannot make such an update heap-only: each change writes a new
entry into every index the row belongs to. Three of those entries were never read:

- ``ix_outbox_message_status_handler`` now leaves out delivered rows. Every
  query that reads it asks for other statuses (counts of unfinished and dead
  messages, dead-letter listings, the start-up check for pending rows of
  unknown routes); delivered totals are a sequential scan either way.
- ``ix_outbox_message_aggregate`` now holds only messages with an aggregate.
- ``ix_outbox_message_lease`` is dropped: lease recovery finds running rows
  through ``ix_outbox_message_status_handler``, which holds them anyway (they
  are a relay's in-flight messages, a few hundred at most). A lease renewal,
  which changes only ``locked_until``, now adds no index entry when the row's
  page has room (a heap-only update).

The predicate is written as equalities joined by OR because SQLite uses a
partial index only when a term of the query appears in it.

Rebuilding an index reads the whole table while holding a lock that blocks
writes (emits) for that time. On a big, busy PostgreSQL table build them
beforehand without that lock; the migration then finds them partial and only
drops the lease index::

    CREATE INDEX CONCURRENTLY ix_outbox_message_status_handler_new ON outbox_message (status, handler)
        WHERE status = 'pending' OR status = 'running' OR status = 'dead' OR status = 'discarded';
    DROP INDEX CONCURRENTLY ix_outbox_message_status_handler;
    ALTER INDEX ix_outbox_message_status_handler_new RENAME TO ix_outbox_message_status_handler;
    CREATE INDEX CONCURRENTLY ix_outbox_message_aggregate_new ON outbox_message (aggregate_type, aggregate_id)
        WHERE aggregate_type IS NOT NULL;
    DROP INDEX CONCURRENTLY ix_outbox_message_aggregate;
    ALTER INDEX ix_outbox_message_aggregate_new RENAME TO ix_outbox_message_aggregate;
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0012"
down_revision = "outbox_0011"
branch_labels = None
depends_on = None

_TABLE = "outbox_message"
_NOT_DELIVERED = "status = 'pending' OR status = 'running' OR status = 'dead' OR status = 'discarded'"
_PARTIAL = (
    ("ix_outbox_message_status_handler", ["status", "handler"], _NOT_DELIVERED),
    ("ix_outbox_message_aggregate", ["aggregate_type", "aggregate_id"], "aggregate_type IS NOT NULL"),
)
_LEASE = "ix_outbox_message_lease"


def _partial_already() -> set[str]:
    """Indexes of ``_PARTIAL`` that exist with a predicate: built beforehand, as the docstring shows."""
    indexes = sa.inspect(op.get_bind()).get_indexes(_TABLE)
    return {
        index["name"]
        for index in indexes
        if index["name"] is not None and any(k.endswith("_where") for k in index.get("dialect_options", {}))
    }


def upgrade() -> None:
    done = _partial_already()
    for name, columns, where in _PARTIAL:
        if name in done:
            continue
        op.drop_index(name, table_name=_TABLE, if_exists=True)
        predicate = sa.text(where)
        op.create_index(name, _TABLE, columns, postgresql_where=predicate, sqlite_where=predicate)
    op.drop_index(_LEASE, table_name=_TABLE, if_exists=True)


def downgrade() -> None:
    for name, columns, _ in _PARTIAL:
        op.drop_index(name, table_name=_TABLE, if_exists=True)
        op.create_index(name, _TABLE, columns)
    running = sa.text("status = 'running'")
    op.create_index(_LEASE, _TABLE, ["locked_until"], postgresql_where=running, sqlite_where=running)
