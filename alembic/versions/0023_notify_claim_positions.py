"""NOTIFY names where in its queue a committed row sorts, so a listening relay never rescans the front.

Revision ID: outbox_0023
Revises: outbox_0022
Create Date: 2026-12-19

While a transaction holds back the xmin horizon (an idle ``BEGIN; SELECT
txid_current()``, a long REPEATABLE READ report), every entry a claimed row
leaves in the claim index stays, and a claim that scans its queue from the
front steps over all of them: measured, one claim read 1 buffer before a
hold, 2,217 after 29 s and 12,172 after 270 s. A listening relay therefore
keeps a position per queue and scans from it (``relay/claim_position.py``);
it needs to hear where a newly committed row sorts, since an id taken early
by a transaction that commits late sorts before the position.

``outbox_notify`` becomes a statement-level trigger with a transition table:
for each queue the statement inserted into, it sends
``pg_notify('outbox', '<schema> <priority> <id> <queue>')``, the first row in
claim order (lowest priority, then lowest id). Within one transaction a later
statement into the same queue at the same priority is not announced again: its
rows sort after the first statement's (ids grow), and the relay scans from the
lowest position it heard. NOTIFY is still delivered only at commit. A payload
of the old shape (the schema alone, as the operator functions and older
triggers send) still wakes every relay, which then scans from the front.

``outbox_claim`` runs with ``enable_sort = off`` and ``enable_seqscan = off``.
Its scan must start at the position in the claim index, ``(queue, priority,
id)``, and its UPDATE must find the taken rows through the primary key. The
planner counts live rows only, and a PL/pgSQL function keeps its plan for the
session: it found it as cheap to read every ``pending`` entry of
``ix_outbox_message_status_handler`` and sort them, or to read the table
whole for the taken ids, as it was when the plan was made. While the horizon
is held the index keeps an entry, and the table a version, for every row ever
pending, and the claim read them all: with one message committed per
transaction at 1,000 a second, a claim of 250 took 2 ms at the start of a
hold and 200 ms 110 s into it (the sort: 3,298 buffers against 275 from the
position; the sequential scan: 59,976 rows read for 49 taken). No plan the
claim should take needs either.

SQLite has no NOTIFY: nothing changes there. The downgrade restores the
trigger and function of ``outbox_0007`` and the claim's default settings.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0023"
down_revision = "outbox_0022"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"


def _notify(s: str) -> str:
    # The transaction-local setting remembers the last announcement: a transaction that emits
    # in many statements to one queue sends one notification, not one per statement.
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_notify() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    r record;
    said text;
BEGIN
    FOR r IN SELECT DISTINCT ON (queue) queue, priority, id FROM inserted ORDER BY queue, priority, id LOOP
        said := TG_TABLE_SCHEMA || ' ' || r.priority || ' ' || r.queue;
        IF current_setting('outbox.notified', true) IS DISTINCT FROM said THEN
            PERFORM pg_notify('outbox',
                              TG_TABLE_SCHEMA || ' ' || r.priority || ' ' || r.id || ' ' || r.queue);
            PERFORM set_config('outbox.notified', said, true);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$
"""


_0007_NOTIFY = """
CREATE OR REPLACE FUNCTION {s}.outbox_notify() RETURNS trigger LANGUAGE plpgsql {pinned} AS $$
BEGIN
    PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$
"""


_CLAIM = "outbox_claim(text, double precision, text, text[], integer, integer, bigint, boolean)"


def _schema() -> str:
    bind = op.get_bind()
    name = str(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    return bind.dialect.identifier_preparer.quote_identifier(name)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = _schema()
    # The function first: CREATE OR REPLACE keeps its owner; the trigger then names the new table.
    op.execute(_notify(s))
    op.execute(f"DROP TRIGGER IF EXISTS outbox_message_notify ON {s}.outbox_message")
    op.execute(
        f"CREATE TRIGGER outbox_message_notify AFTER INSERT ON {s}.outbox_message"
        " REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION"
        f" {s}.outbox_notify()"
    )
    # ALTER FUNCTION ... SET keeps the function's owner, grants and other settings (search_path).
    op.execute(f"ALTER FUNCTION {s}.{_CLAIM} SET enable_sort = off")
    op.execute(f"ALTER FUNCTION {s}.{_CLAIM} SET enable_seqscan = off")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s = _schema()
    op.execute(f"ALTER FUNCTION {s}.{_CLAIM} RESET enable_sort")
    op.execute(f"ALTER FUNCTION {s}.{_CLAIM} RESET enable_seqscan")
    op.execute(f"DROP TRIGGER IF EXISTS outbox_message_notify ON {s}.outbox_message")
    op.execute(_0007_NOTIFY.format(s=s, pinned=_PINNED))
    op.execute(
        f"CREATE TRIGGER outbox_message_notify AFTER INSERT ON {s}.outbox_message"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_notify()"
    )
