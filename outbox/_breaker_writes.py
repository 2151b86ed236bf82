"""What a relay writes to the shared circuit breakers: an opening, a closing, a release of parked messages.

The :class:`~outbox._breaker_board.BreakerBoard` decides when; this module is
how, for each database. On PostgreSQL every write is a call of a ``SECURITY
DEFINER`` function that writes its log row itself (``outbox_breaker_open`` and
``outbox_breaker_close``, migration ``outbox_0019``; ``outbox_unpark``,
``outbox_0021``); SQLite has no roles, so the same rows are written here, for
the one relay a SQLite database has.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert, select, text, update
from sqlalchemy.engine import Connection

from ._tables import outbox_breaker, outbox_breaker_log

__all__ = ["Decision", "write_decision"]

b = outbox_breaker
blog = outbox_breaker_log

_OPEN = text("SELECT outbox_breaker_open(:me, :dest, :route, :failures, :cooldown)")
_CLOSE = text("SELECT outbox_breaker_close(:me, :dest)")


@dataclass(slots=True)
class Decision:
    """A breaker's change of state, as one relay decided it."""

    opened: bool  # True: an opening (or a failed trial's reopening); False: a closing
    route: str = ""
    failures: int = 0
    cooldown: float = 0.0


def write_decision(conn: Connection, relay_id: str, destination: str, decision: Decision) -> None:
    """Write ``decision`` about ``destination`` in the caller's transaction."""
    if conn.dialect.name == "postgresql":
        if decision.opened:
            params = {
                "me": relay_id,
                "dest": destination,
                "route": decision.route,
                "failures": decision.failures,
                "cooldown": decision.cooldown,
            }
            conn.execute(_OPEN, params)
        else:
            conn.execute(_CLOSE, {"me": relay_id, "dest": destination})
        return
    _write_sqlite(conn, relay_id, destination, decision)


def _write_sqlite(conn: Connection, relay_id: str, destination: str, decision: Decision) -> None:
    """What the PostgreSQL functions do, for the one relay a SQLite database has."""
    now = datetime.now(UTC)
    found = conn.execute(select(b.c.handler, b.c.reopen_at).where(b.c.destination == destination)).first()
    if not decision.opened:
        if found is not None:
            conn.execute(b.delete().where(b.c.destination == destination))
            _log(conn, "closed", destination, found.handler, now, relay_id)
        return
    reopen_at = now + timedelta(seconds=decision.cooldown)
    if found is None:
        conn.execute(
            insert(b).values(
                destination=destination,
                handler=decision.route,
                failures=decision.failures,
                opened_at=now,
                reopen_at=reopen_at,
                opened_by=relay_id,
                updated_at=now,
            )
        )
        _log(conn, "opened", destination, decision.route, now, relay_id, failures=decision.failures)
    elif found.reopen_at <= now:  # half-open: a failed trial reopens the same outage
        conn.execute(
            update(b)
            .where(b.c.destination == destination)
            .values(failures=b.c.failures + 1, reopen_at=reopen_at, updated_at=now)
        )


def _log(
    conn: Connection, event: str, destination: str, route: str, now: datetime, relay_id: str, **extra: Any
) -> None:
    conn.execute(
        insert(blog).values(
            event=event, destination=destination, handler=route, at=now, relay_id=relay_id, **extra
        )
    )
