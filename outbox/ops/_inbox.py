"""The inbox's dead letters, read back for an operator (``outbox inbox dead``, the dashboard's Inbox).

A consumer records a message it gives up on in ``outbox_inbox_dead`` (a
handler failed its last time, no handler matches, it came too late). This is
the operator's read of that record; payload and headers pass through the same
redactor as ``outbox show``. Requeueing one is in ``_inbox_actions``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.engine import Engine, Row

from .._redact import Redactor
from .._tables import INBOX_DEAD_STATUSES, outbox_inbox_dead
from ._base import MAX_ID, InvalidRequest, NotFound, as_text, decoded

__all__ = [
    "MAX_DEAD_LETTERS",
    "InboxDeadLetter",
    "check_dead_letter_id",
    "count_inbox_dead_letters",
    "inbox_dead_letter",
    "inbox_dead_letters",
]

d = outbox_inbox_dead
#: The most dead letters one read returns.
MAX_DEAD_LETTERS: Final = 1000


@dataclass(frozen=True, slots=True)
class InboxDeadLetter:
    """One message a consumer gave up on, as ``outbox_inbox_dead`` records it."""

    id: int
    consumer: str
    message_id: str
    event_type: str
    source: str | None
    payload: Any  # secret-looking fields masked
    headers: Any
    sent_at: datetime | None
    attempts: int
    error_type: str
    error: str
    dead_at: datetime  # when it last became dead: a requeued one that failed again, then
    status: str  # dead, requeued (waiting for its consumer) or handled
    requeued_at: datetime | None = None  # the last requeue's time, actor, reason and login
    actor: str | None = None
    reason: str | None = None
    db_user: str | None = None  # PostgreSQL: the login that requeued it, written by the database
    handled_at: datetime | None = None  # when its consumer's handlers took it, after a requeue

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def check_dead_letter_id(dead_id: Any) -> int:
    """A dead letter's id as given: a whole number from 1 to BIGINT's largest, else refused in one line."""
    if isinstance(dead_id, bool) or not isinstance(dead_id, int) or not 1 <= dead_id <= MAX_ID:
        raise InvalidRequest(f"a dead letter id is a whole number from 1 to {MAX_ID}, got {dead_id!r}")
    return dead_id


def _check_status(status: str | None) -> None:
    if status is not None and status not in INBOX_DEAD_STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(INBOX_DEAD_STATUSES)}, got {status!r}")


def _letter(row: Row[Any], redactor: Redactor) -> InboxDeadLetter:
    return InboxDeadLetter(
        id=row.id,
        consumer=row.consumer,
        message_id=row.message_id,
        event_type=row.event_type,
        source=row.source,
        payload=redactor.value(decoded(row.payload)),
        headers=redactor.value(decoded(row.headers)),
        sent_at=row.sent_at,
        attempts=row.attempts,
        error_type=row.error_type,
        error=redactor.text(row.error),
        dead_at=row.dead_at,
        status=row.status,
        requeued_at=row.requeued_at,
        actor=row.actor,
        reason=row.reason,
        db_user=row.db_user,
        handled_at=row.handled_at,
    )


def inbox_dead_letters(
    engine: Engine,
    *,
    consumer: str | None = None,
    status: str | None = "dead",
    limit: int = 100,
    before_id: int | None = None,
    secrets: Iterable[str] = (),
) -> list[InboxDeadLetter]:
    """Dead letters, newest first: of one consumer (an inbox's name) or all, with ``status`` (None: any).

    ``before_id`` pages on: the dead letters older than that id (the last one of the previous page).
    """
    _check_status(status)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_DEAD_LETTERS:
        raise InvalidRequest(f"limit must be 1 to {MAX_DEAD_LETTERS}, got {limit!r}")
    query = select(*as_text(d, "payload", "headers")).order_by(d.c.id.desc()).limit(limit)
    if consumer is not None:
        query = query.where(d.c.consumer == consumer)
    if status is not None:
        query = query.where(d.c.status == status)
    if before_id is not None:
        query = query.where(d.c.id < check_dead_letter_id(before_id))
    redactor = Redactor(secrets)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [_letter(row, redactor) for row in rows]


def inbox_dead_letter(engine: Engine, dead_id: int, *, secrets: Iterable[str] = ()) -> InboxDeadLetter:
    """One dead letter by its id, secrets masked; :class:`NotFound` when there is none."""
    query = select(*as_text(d, "payload", "headers")).where(d.c.id == check_dead_letter_id(dead_id))
    with engine.connect() as conn:
        row = conn.execute(query).first()
    if row is None:
        raise NotFound(f"no inbox dead letter with id {dead_id}")
    return _letter(row, Redactor(secrets))


def count_inbox_dead_letters(
    engine: Engine, *, consumer: str | None = None, status: str | None = "dead"
) -> int:
    """How many dead letters there are of one consumer (or all) with ``status`` (None: any)."""
    _check_status(status)
    query = select(func.count()).select_from(d)
    if consumer is not None:
        query = query.where(d.c.consumer == consumer)
    if status is not None:
        query = query.where(d.c.status == status)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())
