"""The inbox's dead letters, read back for an operator (``outbox inbox dead``).

A consumer records a message it gives up on in ``outbox_inbox_dead`` (a
handler failed its last time, no handler matches, it came too late). This is
the operator's read of that record; payload and headers pass through the same
redactor as ``outbox show``. Requeueing a dead letter is not offered yet: its
table already has the status and columns for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.engine import Engine

from .._redact import Redactor
from .._tables import INBOX_DEAD_STATUSES, outbox_inbox_dead
from ._base import InvalidRequest, as_text, decoded

__all__ = ["MAX_DEAD_LETTERS", "InboxDeadLetter", "inbox_dead_letters"]

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
    dead_at: datetime
    status: str

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def inbox_dead_letters(
    engine: Engine,
    *,
    consumer: str | None = None,
    status: str | None = "dead",
    limit: int = 100,
    secrets: Iterable[str] = (),
) -> list[InboxDeadLetter]:
    """Dead letters, newest first: of one consumer (an inbox's name) or all, with ``status`` (None: any)."""
    if status is not None and status not in INBOX_DEAD_STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(INBOX_DEAD_STATUSES)}, got {status!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_DEAD_LETTERS:
        raise InvalidRequest(f"limit must be 1 to {MAX_DEAD_LETTERS}, got {limit!r}")
    query = select(*as_text(d, "payload", "headers")).order_by(d.c.id.desc()).limit(limit)
    if consumer is not None:
        query = query.where(d.c.consumer == consumer)
    if status is not None:
        query = query.where(d.c.status == status)
    redactor = Redactor(secrets)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [
        InboxDeadLetter(
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
        )
        for row in rows
    ]
