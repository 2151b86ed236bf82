"""Each attempt's history row is written once, even when the relay sends its outcome twice.

Revision ID: outbox_0008
Revises: outbox_0007
Create Date: 2026-12-03

The relay writes outcomes in batches. When the reply to a batch that did commit
is lost (a dropped connection, a server restart at the wrong moment), the relay
cannot tell, and writes the batch again: the message rows are no longer its to
update, but the history rows were appended a second time. A unique index on
``(message_id, attempt, outcome, started_at)`` now lets the relay insert with
``ON CONFLICT DO NOTHING``. ``started_at`` is the relay's own stamp of when the
attempt began, identical in a re-sent batch and different for every other row
of the same attempt number (a ``lease_expired`` row, a re-attempt after an
attempt that did not count). It replaces the plain index on
``(message_id, attempt)``, which it covers.

A database that already holds such duplicates cannot take the index; the
upgrade then stops and says how many there are. They can be found with::

    SELECT message_id, attempt, outcome, started_at, count(*)
      FROM outbox_attempt GROUP BY 1, 2, 3, 4 HAVING count(*) > 1;

and, history being append-only, leave only through ``outbox purge``.

On SQLite, ``INSERT OR REPLACE`` resolves a conflict on any unique key by
deleting the old row without firing DELETE triggers; the guard of
``outbox_0007`` covers ``id``, and a second one covers this key: an insert that
repeats a row's key is skipped, as ``ON CONFLICT DO NOTHING`` would, so it can
never replace the row already there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0008"
down_revision = "outbox_0007"
branch_labels = None
depends_on = None

_COLUMNS = ["message_id", "attempt", "outcome", "started_at"]

_DUPLICATES = sa.text(
    "SELECT count(*) FROM (SELECT 1 FROM outbox_attempt"
    " GROUP BY message_id, attempt, outcome, started_at HAVING count(*) > 1) AS twice"
)


_SQLITE_KEY_KEPT = (
    "CREATE TRIGGER outbox_attempt_once_kept BEFORE INSERT ON outbox_attempt"
    " WHEN EXISTS (SELECT 1 FROM outbox_attempt WHERE message_id = NEW.message_id"
    " AND attempt = NEW.attempt AND outcome = NEW.outcome AND started_at = NEW.started_at)"
    " BEGIN SELECT RAISE(IGNORE); END"
)


def upgrade() -> None:
    duplicated = op.get_bind().execute(_DUPLICATES).scalar_one()
    if duplicated:
        raise RuntimeError(
            f"outbox_attempt holds {duplicated} history row(s) written more than once by a relay "
            "retrying an outcome batch; see the docstring of migration outbox_0008 to find them, "
            "purge them (outbox purge), then upgrade again"
        )
    op.create_index("ux_outbox_attempt_once", "outbox_attempt", _COLUMNS, unique=True)
    op.drop_index("ix_outbox_attempt_message_id", table_name="outbox_attempt")
    if op.get_bind().dialect.name == "sqlite":
        op.execute(_SQLITE_KEY_KEPT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_once_kept")
    op.create_index("ix_outbox_attempt_message_id", "outbox_attempt", ["message_id", "attempt"])
    op.drop_index("ux_outbox_attempt_once", table_name="outbox_attempt")
