"""Parked messages: deferred until their destination recovers, then released all at once.

A handler that finds its destination unavailable (a broker unreachable, a
webhook receiver behind an open circuit breaker) raises
``RetryLater(until_recovered=destination)``; the relay records the
destination in ``outbox_message.parked_on`` with a long safety delay. When the
destination is back (a broker publisher reconnects, a trial request succeeds,
an operator resets the breaker) :func:`unpark` makes every pending message
parked on it due now and clears the column, so nothing waits out its delay
once the destination can take it; should that news be lost, the delay alone
brings each message back.

On PostgreSQL the release is the ``SECURITY DEFINER`` function
``outbox_unpark`` (migration ``outbox_0021``), which also wakes the relays
(NOTIFY); on SQLite the statement below, the relay's own clock as "now".
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import case, text, update
from sqlalchemy.engine import Connection

from ._tables import outbox_message

__all__ = ["unpark"]

m = outbox_message

_UNPARK = text("SELECT outbox_unpark(:destination)")


def unpark(conn: Connection, destination: str) -> int:
    """Release the pending messages parked on ``destination``, in the caller's transaction; how many."""
    if conn.dialect.name == "postgresql":
        return int(conn.execute(_UNPARK, {"destination": destination}).scalar_one())
    now = datetime.now(UTC)
    released = conn.execute(
        update(m)
        .where(m.c.parked_on == destination, m.c.status == "pending")
        .values(
            available_at=case((m.c.available_at > now, now), else_=m.c.available_at),
            parked_on=None,
            updated_at=now,
        )
    )
    return int(released.rowcount)
