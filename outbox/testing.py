"""Helpers for an application's own test suite: see what was stored, deliver it, assert on it.

No relay process is needed::

    from outbox.testing import drain, recording

    def test_signup_sends_welcome(engine):
        with recording(engine) as rec:
            signup(engine, "a@example.com")          # commits
        rec.assert_emitted("user.signed_up", payload={"email": "a@example.com"})
        result = drain(ob, engine)                   # runs the real handlers, here and now
        assert result.delivered == 2

Everything reads committed rows, because that is the promise: an event that
was rolled back must not show up here either. Importing this module does not
load the relay; :func:`drain` does, when it is called.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import URL, Connection, Engine, Row
from sqlalchemy.orm import Session

from ._outbox import Outbox
from ._tables import outbox_message

if TYPE_CHECKING:
    # The checkout maps relay/ into outbox.relay only when installed, which the
    # type checker of this repository cannot follow; installed users get the types.
    from outbox.relay import DrainResult  # type: ignore[import-not-found,unused-ignore]

__all__ = ["Recording", "adrain", "drain", "messages", "recording"]

_Bind = Engine | Connection | Session | str | URL


def _engine(bind: _Bind) -> Engine | str | URL:
    if isinstance(bind, Session):
        engine = bind.get_bind()
        return engine if isinstance(engine, Engine) else engine.engine
    if isinstance(bind, Connection):
        return bind.engine
    return bind


def drain(outbox: Outbox, bind: _Bind, **relay_options: Any) -> DrainResult:
    """Deliver every due message through ``outbox``'s handlers, in this thread, and return the counts.

    Retries that fall due while draining are attempted too; a retry scheduled
    for later stays pending (shorten the route's ``backoff`` in tests). Extra
    keyword arguments go to :class:`outbox.relay.Relay`.
    """
    from outbox.relay import Relay  # type: ignore[import-not-found,unused-ignore]

    relay_options.setdefault("listen", False)
    return Relay(outbox, _engine(bind), **relay_options).run_until_idle()


async def adrain(outbox: Outbox, bind: _Bind, **relay_options: Any) -> DrainResult:
    """:func:`drain` for tests that already run an event loop (async handlers run on it)."""
    from outbox.relay import Relay  # type: ignore[import-not-found,unused-ignore]

    relay_options.setdefault("listen", False)
    return await Relay(outbox, _engine(bind), **relay_options).drain()


def messages(bind: _Bind, *, after_id: int = 0, **columns: Any) -> list[Row[Any]]:
    """Committed ``outbox_message`` rows, oldest first, filtered by equality on any column.

    ``messages(engine, event_type="user.signed_up", status="delivered")``
    """
    engine = _engine(bind)
    stmt = select(outbox_message).where(outbox_message.c.id > after_id).order_by(outbox_message.c.id)
    for name, value in columns.items():
        if name not in outbox_message.c:
            raise TypeError(f"outbox_message has no column {name!r}")
        stmt = stmt.where(outbox_message.c[name] == value)
    with _connect(engine) as conn:
        return list(conn.execute(stmt))


@contextmanager
def _connect(engine: Engine | str | URL) -> Iterator[Connection]:
    if isinstance(engine, Engine):
        with engine.connect() as conn:
            yield conn
        return
    from sqlalchemy import create_engine

    owned = create_engine(engine)
    try:
        with owned.connect() as conn:
            yield conn
    finally:
        owned.dispose()


class Recording:
    """The messages committed since the ``recording()`` block began."""

    def __init__(self, bind: _Bind) -> None:
        self._bind = bind
        with _connect(_engine(bind)) as conn:
            self.start_id: int = conn.execute(
                select(func.coalesce(func.max(outbox_message.c.id), 0))
            ).scalar_one()

    def messages(self, **columns: Any) -> list[Row[Any]]:
        return messages(self._bind, after_id=self.start_id, **columns)

    def event_types(self) -> list[str]:
        """One entry per event (not per route), in emit order."""
        seen: dict[Any, str] = {}
        for row in self.messages():
            seen.setdefault(row.event_id, row.event_type)
        return list(seen.values())

    def assert_emitted(
        self, event_type: str, *, payload: Mapping[str, Any] | None = None, count: int | None = None
    ) -> list[Row[Any]]:
        """Assert events of ``event_type`` were committed (``payload`` must match exactly, if given).

        ``count`` counts events, not routes. Returns the matching rows.
        """
        rows = [
            r for r in self.messages(event_type=event_type) if payload is None or r.payload == dict(payload)
        ]
        events = {r.event_id for r in rows}
        if not events or (count is not None and len(events) != count):
            found = self.event_types()
            wanted = f"{count if count is not None else 'some'} {event_type!r} event(s)"
            if payload is not None:
                wanted += f" with payload {dict(payload)!r}"
            raise AssertionError(f"expected {wanted}, found {len(events)}; committed event types: {found}")
        return rows

    def assert_nothing_emitted(self) -> None:
        found = self.event_types()
        if found:
            raise AssertionError(f"expected no committed events, found {found}")


@contextmanager
def recording(bind: _Bind) -> Iterator[Recording]:
    """Record the outbox messages committed inside the block (and after it, until you look)."""
    yield Recording(bind)
