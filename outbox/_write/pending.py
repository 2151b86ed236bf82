"""Which emitted events a session still owes the database, tracked per transaction.

Events are buffered in the session and written in batches (after a flush, or
just before a commit). Each buffered event remembers the transaction or
savepoint it was emitted in (``tag``) and, once written, the one it was written
in (``written_in``). When a savepoint or transaction rolls back:

- events emitted inside it are dropped (they never happened);
- events emitted outside it but written inside it are owed again, because the
  database just discarded those rows.

So an event is stored if and only if the transaction it was emitted in, and
every enclosing one, commits; and a flush inside a savepoint can never lose an
event of the enclosing transaction. Clearing the buffer on every rollback, as
naive implementations do, would lose the outer transaction's events.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, SessionTransaction

from .settings import EmitSettings

__all__ = ["PendingEvent", "SessionEvents", "events_of", "innermost"]

_INFO_KEY = "_sqlalchemy_outbox_events"


@dataclass(slots=True, eq=False)
class PendingEvent:
    outbox: EmitSettings
    event_id: uuid.UUID
    rows: list[dict[str, Any]]
    aggregate: Any = None
    tag: SessionTransaction | None = None
    written_in: SessionTransaction | None = None
    #: A key or group key holds {aggregate_id} for an id assigned at the flush (``keys.KeyTemplate``).
    waits_for_id: bool = False
    #: Rows the last write of this event dropped as duplicates of a stored key (``dedupe``).
    dropped: list[dict[str, Any]] | None = None


def _within(transaction: SessionTransaction | None, scope: SessionTransaction) -> bool:
    while transaction is not None:
        if transaction is scope:
            return True
        transaction = transaction.parent
    return False


def _boundary(transaction: SessionTransaction) -> SessionTransaction:
    """The savepoint or database transaction whose rollback the database performed."""
    current: SessionTransaction | None = transaction
    while current is not None:
        if current.nested or current.parent is None:
            return current
        current = current.parent
    return transaction


def innermost(session: Session) -> SessionTransaction | None:
    """The transaction a statement would run in now: the open savepoint, else the root.

    A session that autobegins begins its root now, as ``session.add()`` does, so
    an event emitted between transactions belongs to a transaction whose
    rollback or close discards it. Otherwise a ``rollback()`` or ``close()``
    with nothing begun would leave it buffered, and the next commit would store
    it. (A session with autobegin off keeps it untagged until ``begin()``.)
    """
    current = session.get_nested_transaction() or session.get_transaction()
    if current is None and session.autobegin:
        current = session.begin()
    return current


@dataclass(slots=True)
class SessionEvents:
    """The buffer of one session; lives in ``session.info``."""

    events: list[PendingEvent] = field(default_factory=list)
    #: True while ``before_commit`` writes and may pipeline: the last write before the COMMIT.
    committing: bool = False
    #: A ``before_commit`` (of the transaction or a savepoint) has written; until that
    #: transaction or savepoint ends, later emits must write at once.
    commit_written: bool = False
    #: The connection this transaction's events were written on (``dedupe`` reads there after the commit).
    connection: Connection | None = None

    def add(self, event: PendingEvent) -> None:
        self.events.append(event)

    def discard(self, event: PendingEvent) -> None:
        self.events = [kept for kept in self.events if kept is not event]

    def unwritten(self) -> list[PendingEvent]:
        return [event for event in self.events if event.written_in is None]

    def written(self) -> list[PendingEvent]:
        return [event for event in self.events if event.written_in is not None]

    def adopt(self, root: SessionTransaction) -> None:
        """Events emitted before any transaction began belong to the first one."""
        for event in self.events:
            if event.tag is None:
                event.tag = root

    def rolled_back(self, transaction: SessionTransaction) -> None:
        scope = _boundary(transaction)
        kept = []
        for event in self.events:
            if _within(event.tag, scope):
                continue
            if event.written_in is not None and _within(event.written_in, scope):
                event.written_in = None
            kept.append(event)
        self.events = kept

    def ended(self, root: SessionTransaction) -> None:
        self.events = [event for event in self.events if not _within(event.tag, root)]


def events_of(session: Session, *, create: bool = True) -> SessionEvents | None:
    state = session.info.get(_INFO_KEY)
    if state is None and create:
        state = session.info[_INFO_KEY] = SessionEvents()
    return state
