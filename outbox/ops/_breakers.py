"""Circuit breakers every relay shares (``outbox_breaker``): which are open, and closing one by hand.

A relay whose deliveries to a destination keep failing opens its breaker, and
every relay of the database skips that destination until the breaker's reopen
time; then each may send one trial request, and the first that succeeds closes
it for all. An operator who knows better (the partner says it is back) resets
it: every relay sends to it again within about a second, and the messages
parked on it (``outbox_message.parked_on``) are due at once (``outbox_unpark``,
migration ``outbox_0021``). ``outbox retry-now`` does the same for the
breakers of the messages it makes due, or the relay would turn them away again
at once.

Each reset is a row of ``outbox_breaker_log`` with the actor and the reason,
written in the transaction that deletes the breaker: on PostgreSQL by the
``SECURITY DEFINER`` function ``outbox_breaker_reset`` (migration
``outbox_0019``), which stamps the login; on SQLite from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Text, cast, func, insert, inspect, or_, select
from sqlalchemy.engine import Connection, Engine, Row

from .._parking import unpark
from .._tables import outbox_breaker, outbox_breaker_log
from ._base import InvalidRequest, OpsError, _check_reason, _now, a, decoded
from ._in_database import call

__all__ = ["Breaker", "BreakerNotOpen", "breakers", "breakers_on", "clear_for_retry", "reset_breaker"]

b = outbox_breaker
blog = outbox_breaker_log

#: The longest destination the table takes (the database functions' limit).
DESTINATION_LIMIT = 1000


class BreakerNotOpen(OpsError):
    """A reset named a destination whose breaker is not open."""


@dataclass(frozen=True, slots=True)
class Breaker:
    """A destination every relay skips (``open``) or sends one trial request to (``half-open``)."""

    destination: str  # host:port, as the webhook handler keys it
    route: str  # the route whose deliveries opened it
    state: str  # "open" until reopen_at, "half-open" after it
    since: datetime  # when it opened (a failed trial reopens it, keeping this)
    failures: int  # the consecutive failures that opened it, plus one per failed trial
    reopen_at: datetime  # when relays may send a trial request
    opened_by: str  # the relay id that opened it

    def as_dict(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "route": self.route,
            "state": self.state,
            "since": self.since,
            "failures": self.failures,
            "reopen_at": self.reopen_at,
            "opened_by": self.opened_by,
        }


def _clock(conn: Connection) -> datetime:
    """The clock relays open breakers by: the server's on PostgreSQL, this host's UTC clock on SQLite."""
    if conn.dialect.name == "postgresql":
        now: datetime = conn.execute(select(func.now())).scalar_one()
        return now
    return _now()


def _breaker(row: Any, now: datetime) -> Breaker:
    return Breaker(
        destination=row.destination,
        route=row.handler,
        state="open" if row.reopen_at > now else "half-open",
        since=row.opened_at,
        failures=row.failures,
        reopen_at=row.reopen_at,
        opened_by=row.opened_by,
    )


def breakers_on(conn: Connection) -> list[Breaker]:
    """Open and half-open breakers, oldest first; none on a database not migrated to ``outbox_0019``."""
    if not inspect(conn).has_table(b.name):
        return []
    now = _clock(conn)
    rows = conn.execute(select(b).order_by(b.c.opened_at, b.c.destination)).all()
    return [_breaker(row, now) for row in rows]


def breakers(engine: Engine) -> list[Breaker]:
    """Every destination whose breaker is open or half-open now, oldest first."""
    with engine.connect() as conn:
        return breakers_on(conn)


def _check_destination(destination: str) -> str:
    if not isinstance(destination, str) or not destination.strip():
        raise InvalidRequest("name the destination to reset: host:port, as `outbox breaker list` shows it")
    if len(destination) > DESTINATION_LIMIT:
        raise InvalidRequest(
            f"a destination is at most {DESTINATION_LIMIT} characters, not {len(destination)}"
        )
    return destination


def reset_breaker(engine: Engine, destination: str, *, reason: str, actor: str) -> Breaker:
    """Close the breaker of ``destination`` for every relay; returns it as it was.

    Every relay sends to the destination again within about a second, and
    the messages the breaker held back (parked on it) are due at once.
    Raises
    :class:`BreakerNotOpen` when the destination has no open breaker: a
    mistyped name must not look like a reset.
    """
    destination = _check_destination(destination)
    _check_reason(reason, actor)
    with engine.begin() as conn:
        gone = _reset(conn, [destination], [], actor, reason, "reset")
        if not gone:
            others = ", ".join(x.destination for x in breakers_on(conn))
            raise BreakerNotOpen(
                f"no circuit breaker is open for {destination!r}; nothing to reset"
                + (f" (open now: {others})" if others else " (none is open)")
            )
    return gone[0]


def _reset(
    conn: Connection, destinations: Sequence[str], routes: Sequence[str], actor: str, reason: str, event: str
) -> list[Breaker]:
    """Delete the breakers of ``destinations`` and of ``routes``, each with a log row; returns them."""
    if conn.dialect.name == "postgresql":
        rows = call(
            conn,
            "SELECT reset_destination AS destination, reset_handler AS handler, reset_failures AS failures,"
            " reset_opened_at AS opened_at, reset_reopen_at AS reopen_at, reset_opened_by AS opened_by"
            " FROM outbox_breaker_reset(:destinations, :routes, :actor, :reason, :event)",
            destinations=list(destinations),
            routes=list(routes),
            actor=actor,
            reason=reason,
            event=event,
        )
        now = _clock(conn)
        for row in rows:
            _release(conn, row.destination)
        return [_breaker(row, now) for row in rows]
    now = _now()
    matching = or_(b.c.destination.in_(list(destinations)), b.c.handler.in_(list(routes)))
    deleted = conn.execute(b.delete().where(matching).returning(*b.c)).all()
    rows = sorted(deleted, key=lambda row: row.destination)
    for row in rows:
        conn.execute(
            insert(blog).values(
                event=event,
                destination=row.destination,
                handler=row.handler,
                at=now,
                actor=actor,
                reason=reason,
            )
        )
        _release(conn, row.destination)
    return [_breaker(row, now) for row in rows]


def _release(conn: Connection, destination: str) -> None:
    """What the breaker held back parked goes out now (outbox_0021), in the reset's transaction."""
    if conn.dialect.name == "postgresql":
        call(conn, "SELECT outbox_unpark(:destination)", destination=destination)
    else:
        unpark(conn, destination)


def _deferred_by(conn: Connection, ids: Sequence[int]) -> set[str]:
    """Destinations whose breaker turned these messages away (their latest deferral's detail names it)."""
    latest = (
        select(func.max(a.c.id))
        .where(a.c.message_id.in_(list(ids)), a.c.outcome == "retry")
        .group_by(a.c.message_id)
    )
    found: set[str] = set()
    for document in conn.execute(select(cast(a.c.detail, Text)).where(a.c.id.in_(latest))).scalars():
        detail = decoded(document)
        if isinstance(detail, dict) and detail.get("breaker") and isinstance(detail.get("destination"), str):
            found.add(detail["destination"])
    return found


def clear_for_retry(
    conn: Connection, rows: Iterable[Row[Any]], done: Sequence[int], *, actor: str, reason: str
) -> list[Breaker]:
    """The breakers a retry-now of ``done`` (of ``rows``) clears, in the retry-now's transaction.

    Those that turned one of the messages away (named by its history), and
    those opened by one of their routes: otherwise a relay would defer the
    messages again the moment they are due. Logged as ``retried_now`` with the
    retry-now's actor and reason. A database not migrated to ``outbox_0019``
    has none to clear.
    """
    if not done or not inspect(conn).has_table(b.name):
        return []
    made_due = set(done)
    routes = sorted({row.handler for row in rows if row.id in made_due})
    destinations = sorted(_deferred_by(conn, done))
    matching = or_(b.c.destination.in_(destinations), b.c.handler.in_(routes))
    if conn.execute(select(b.c.destination).where(matching).limit(1)).first() is None:
        return []  # the usual case: nothing open, nothing written
    return _reset(conn, destinations, routes, actor, reason, "retried_now")
