"""What "now" is in the relay's statements: the server's clock on PostgreSQL, this host's on SQLite.

On PostgreSQL it is the server's ``now()``, the same clock the write side
stamps ``available_at`` with, so app-server and relay-host clock skew cannot
delay or hasten a delivery. SQLite has no server, so the relay's own UTC clock
is used there. The claims, the lease renewals, the outcome writes and the
registry row all take "now" from here, so they can never disagree on it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, Interval, bindparam, func, literal
from sqlalchemy.engine import Engine

from outbox import outbox_message

__all__ = ["StatementClock", "utcnow"]

m = outbox_message


def utcnow() -> datetime:
    return datetime.now(UTC)


class StatementClock:
    """One engine's "now": the store, the outcome writes and the registry each ask one, so none disagree."""

    __slots__ = ("server_clock",)

    def __init__(self, engine: Engine) -> None:
        self.server_clock = engine.dialect.name == "postgresql"

    def now(self) -> ColumnElement[datetime]:
        if self.server_clock:
            return func.now()
        return literal(utcnow(), type_=m.c.available_at.type)

    def later(self, param: str) -> ColumnElement[datetime]:
        """ "now" plus a per-row interval bound under ``param`` (a timedelta)."""
        if self.server_clock:
            return func.now() + bindparam(param, type_=Interval())
        # SQLite: the caller binds the absolute time under the same name.
        return bindparam(param, type_=m.c.available_at.type)

    def bind_later(self, delay: timedelta) -> timedelta | datetime:
        """The value to bind under :meth:`later`'s ``param`` for a delay from now."""
        return delay if self.server_clock else utcnow() + delay
