"""Make history old enough to purge, the way only the tables' owner can.

A purge never deletes history younger than ``ops.MIN_HISTORY_AGE``, so a test
that purges what a relay just wrote first moves that history into the past.
Rewriting history is exactly what the append-only triggers refuse; the owner
(these tests connect as it) sets them aside for one transaction, which is the
power docs/operations.md's threat model gives the owner and nobody else.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, text, update
from sqlalchemy.engine import Engine

import outbox

a = outbox.outbox_attempt


def age_history(engine: Engine, by: timedelta = timedelta(days=2)) -> None:
    """Move every history row's timestamps ``by`` into the past."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE outbox_attempt DISABLE TRIGGER outbox_attempt_append_only"))
        else:
            guard = conn.execute(
                text("SELECT sql FROM sqlite_master WHERE name = 'outbox_attempt_no_update'")
            ).scalar_one()
            conn.execute(text("DROP TRIGGER outbox_attempt_no_update"))
        for row in conn.execute(select(a.c.id, a.c.started_at, a.c.finished_at)).all():
            conn.execute(
                update(a)
                .where(a.c.id == row.id)
                .values(
                    started_at=row.started_at - by,
                    finished_at=None if row.finished_at is None else row.finished_at - by,
                )
            )
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE outbox_attempt ENABLE TRIGGER outbox_attempt_append_only"))
        else:
            conn.execute(text(guard))


def age_markers(engine: Engine, by: timedelta, **where: str) -> None:
    """Move inbox markers (those whose columns equal ``where``, or all) ``by`` into the past.

    Markers are never updated; the owner sets the guard aside as for history.
    """
    i = outbox.outbox_inbox
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE outbox_inbox DISABLE TRIGGER outbox_inbox_kept"))
        else:
            guard = conn.execute(
                text("SELECT sql FROM sqlite_master WHERE name = 'outbox_inbox_no_update'")
            ).scalar_one()
            conn.execute(text("DROP TRIGGER outbox_inbox_no_update"))
        query = select(i.c.consumer, i.c.message_id, i.c.received_at, i.c.kept_until)
        for column, value in where.items():
            query = query.where(i.c[column] == value)
        for row in conn.execute(query).all():
            conn.execute(
                update(i)
                .where(i.c.consumer == row.consumer, i.c.message_id == row.message_id)
                .values(received_at=row.received_at - by, kept_until=row.kept_until - by)
            )
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE outbox_inbox ENABLE TRIGGER outbox_inbox_kept"))
        else:
            conn.execute(text(guard))
