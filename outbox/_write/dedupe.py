"""Duplicates the INSERT dropped: found at the write, announced once the transaction commits.

``ON CONFLICT (handler, idempotency_key) DO NOTHING`` stores a key once per
route and never raises in the emitter's transaction: a retried request is
quietly absorbed. Quiet must not mean invisible, so a write with a key asks
the database which rows it stored (``RETURNING handler, idempotency_key``:
columns an emitting role may already read, for the conflict check) and
remembers, on each buffered event, the rows it dropped. A write without a key
cannot conflict and is sent exactly as before.

When the transaction commits, each dropped row is announced: the
``event_deduplicated`` signal (with the id of the message that holds the key),
a DEBUG line on the ``outbox.write`` logger (action ``deduplicated``) and a
count per route (``Outbox.deduplicated``). A transaction that rolls back
announces nothing, since it stored nothing; a savepoint's rollback forgets
what it wrote, and the rewrite decides again.

The existing message's id takes one more SELECT, made only when something
was dropped, after the commit, on the connection that wrote (its own short
transaction, or a savepoint inside one the session does not own), so it can
never fail the commit that already succeeded. A login without ``SELECT (id)``
on ``outbox_message`` gets ``existing_id=None``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, tuple_
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from .. import signals
from .._tables import outbox_message

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from .pending import PendingEvent

__all__ = ["Settle", "announce", "dropped_indexes", "keyed"]

log = logging.getLogger("outbox.write")
m = outbox_message

#: Takes an INSERT's answer about keyed rows: how many it stored, and (asked only if fewer than
#: sent) their (handler, idempotency_key) pairs.
Settle = Callable[[int, Callable[[], Iterable[tuple[Any, Any]]]], None]


def keyed(rows: Sequence[dict[str, Any]]) -> bool:
    """Can this batch conflict? Only a row with a key can."""
    return any(row["idempotency_key"] is not None for row in rows)


def dropped_indexes(rows: Sequence[dict[str, Any]], stored: Iterable[tuple[Any, Any]]) -> list[int]:
    """Indexes of the keyed rows the INSERT did not store, given the (handler, key) pairs it returned.

    Counted, not just looked up: two rows of one batch with the same pair store
    the first (the database inserts VALUES in order) and drop the second.
    """
    left = Counter((handler, key) for handler, key in stored if key is not None)
    dropped = []
    for index, row in enumerate(rows):
        key = row["idempotency_key"]
        if key is None:
            continue
        pair = (row["handler"], key)
        if left[pair]:
            left[pair] -= 1
        else:
            dropped.append(index)
    return dropped


def _existing_ids(connection: Connection | None, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    """The ids of the messages holding these (route, key) pairs; empty when they cannot be read."""
    if connection is None or connection.closed or connection.invalidated:
        return {}
    query = select(m.c.id, m.c.handler, m.c.idempotency_key).where(
        tuple_(m.c.handler, m.c.idempotency_key).in_(sorted(set(pairs)))
    )
    scope: Any = None
    try:
        # Inside a transaction someone else owns (a session joined to an outer one), a savepoint
        # keeps a refused SELECT from aborting it on PostgreSQL (SQLite has no grants to refuse
        # it); otherwise the SELECT gets a transaction of its own, ended here.
        if not connection.in_transaction():
            scope = connection.begin()
        elif connection.dialect.name == "postgresql":
            scope = connection.begin_nested()
        try:
            found = {(r.handler, r.idempotency_key): r.id for r in connection.execute(query)}
        except BaseException:
            if scope is not None:
                scope.rollback()
            raise
        # It only read: ending it with COMMIT (or RELEASE) keeps psycopg's prepared statements,
        # which it deallocates at every ROLLBACK, so the next emitting commits stay fast.
        if scope is not None:
            scope.commit()
    except SQLAlchemyError as exc:
        log.debug(
            "the ids of the messages holding duplicate keys could not be read: %s",
            type(exc).__name__,
            extra={"action": "deduplicated"},
        )
        return {}
    return found


def announce(session: Session, connection: Connection | None, events: Iterable[PendingEvent]) -> None:
    """Signal, log and count every row the committed transaction's writes dropped."""
    drops = [(event, row) for event in events if event.dropped for row in event.dropped]
    if not drops:
        return
    existing = _existing_ids(connection, [(row["handler"], row["idempotency_key"]) for _, row in drops])
    for event, row in drops:
        route, key = row["handler"], row["idempotency_key"]
        existing_id = existing.get((route, key))
        outbox = event.outbox
        outbox._dedupe_counter.add(route)
        log.debug(
            "event %s (%s) not stored for route %s: key %r is already held by message %s",
            event.event_id,
            row["event_type"],
            route,
            key,
            existing_id,
            extra={
                "action": "deduplicated",
                "event_id": str(event.event_id),
                "event_type": row["event_type"],
                "handler": route,
                "message_id": existing_id,
            },
        )
        if signals.event_deduplicated.receivers:
            signals.event_deduplicated.send(
                outbox,
                session=session,
                event_id=event.event_id,
                event_type=row["event_type"],
                route=route,
                key=key,
                existing_id=existing_id,
            )
