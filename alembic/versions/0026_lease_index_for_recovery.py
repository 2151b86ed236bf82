"""Running messages get an index of their own, by lease: lease recovery reads only what ran out since.

Revision ID: outbox_0026
Revises: outbox_0025
Create Date: 2026-12-07

Lease recovery looked for running messages whose lease had run out through
``ix_outbox_message_status_handler``, which held every unfinished status. While
a transaction holds back the xmin horizon, that index keeps an entry for
every row that was ever running (each claim adds one, and nothing may remove
the old ones), and every look walked them all: in a pressure run at 1,000
messages a second, 200-300 ms every 10 s after ten minutes of a held
transaction, growing with the hold.

- ``ix_outbox_message_lease (locked_until) WHERE status = 'running'`` comes
  back (``outbox_0012`` had dropped it): the relay now reads the leases that
  ran out since its last look, a range of this index, instead of all of them.
- On PostgreSQL ``ix_outbox_message_status_handler`` leaves running rows out, so a claim
  writes its entry into the lease index instead of into this one: a delivery
  writes as many index entries as before. Counts and listings of running
  messages read the lease index.

On SQLite the lease index comes too, and the status index keeps its running
rows: SQLite reads a count of several statuses through one partial index
only, which the split would have cost every count of unfinished messages
there; a claim there writes one more index entry.

A lease renewal changes ``locked_until``, which is now indexed: it writes a
new entry into each index of the row rather than, when the row's page had
room, none. A renewal comes every third of the lease, for deliveries that
outlast it.

Rebuilding an index reads the whole table while holding a lock that blocks
writes (emits) for that time. On a big, busy PostgreSQL table build them
beforehand without that lock; the migration then finds both as they should
be and changes nothing::

    CREATE INDEX CONCURRENTLY ix_outbox_message_lease ON outbox_message (locked_until)
        WHERE status = 'running';
    CREATE INDEX CONCURRENTLY ix_outbox_message_status_handler_new ON outbox_message (status, handler)
        WHERE status = 'pending' OR status = 'dead' OR status = 'discarded';
    DROP INDEX CONCURRENTLY ix_outbox_message_status_handler;
    ALTER INDEX ix_outbox_message_status_handler_new RENAME TO ix_outbox_message_status_handler;
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0026"
down_revision = "outbox_0025"
branch_labels = None
depends_on = None

_TABLE = "outbox_message"
_STATUS = "ix_outbox_message_status_handler"
_LEASE = "ix_outbox_message_lease"
_RUNNING = "status = 'running'"
#: The status index's predicate, as this migration leaves it and as ``outbox_0012`` did.
_WAITING_OR_DEAD = "status = 'pending' OR status = 'dead' OR status = 'discarded'"
_NOT_DELIVERED = "status = 'pending' OR status = 'running' OR status = 'dead' OR status = 'discarded'"


def _predicates() -> dict[str, str | None]:
    """Each index of the table by name, with its predicate as the database prints it (None: whole)."""
    bind = op.get_bind()
    found: dict[str, str | None] = {}
    for index in sa.inspect(bind).get_indexes(_TABLE):
        where = index.get("dialect_options", {}).get(f"{bind.dialect.name}_where")
        found[str(index["name"])] = None if where is None else str(where)
    return found


def _status_index(where: str) -> None:
    predicate = sa.text(where)
    op.drop_index(_STATUS, table_name=_TABLE, if_exists=True)
    columns = ["status", "handler"]
    op.create_index(_STATUS, _TABLE, columns, postgresql_where=predicate, sqlite_where=predicate)


def upgrade() -> None:
    found = _predicates()
    if _LEASE not in found:
        running = sa.text(_RUNNING)
        op.create_index(_LEASE, _TABLE, ["locked_until"], postgresql_where=running, sqlite_where=running)
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite keeps running rows in the status index too
    if "running" in (found.get(_STATUS) or "running"):  # still holds running rows: rebuilt
        _status_index(_WAITING_OR_DEAD)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _status_index(_NOT_DELIVERED)
    op.drop_index(_LEASE, table_name=_TABLE, if_exists=True)
