"""Committed rows: ``messages()``, ``recording()``, and the assertions a recording and a capture share."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.engine import Row

from .._tables import outbox_message
from ._binds import committed

if TYPE_CHECKING:
    from ._binds import Bind

__all__ = ["Recording", "RowAssertions", "check_columns", "messages", "recording"]


def check_columns(columns: Mapping[str, Any]) -> None:
    for name in columns:
        if name not in outbox_message.c:
            raise TypeError(f"outbox_message has no column {name!r}")


def messages(bind: Bind, *, after_id: int = 0, **columns: Any) -> list[Row[Any]]:
    """Committed ``outbox_message`` rows, oldest first, filtered by equality on any column.

    ``messages(engine, event_type="user.signed_up", status="delivered")``
    """
    check_columns(columns)
    stmt = select(outbox_message).where(outbox_message.c.id > after_id).order_by(outbox_message.c.id)
    for name, value in columns.items():
        stmt = stmt.where(outbox_message.c[name] == value)
    with committed(bind) as conn:
        return list(conn.execute(stmt))


class RowAssertions:
    """Questions about a set of ``outbox_message`` rows: which events, which payloads, as expected?"""

    #: How the rows came to be there, for failure messages ("committed", "stored").
    _seen = "committed"

    def messages(self, **columns: Any) -> list[Row[Any]]:
        raise NotImplementedError

    def event_types(self) -> list[str]:
        """One entry per event (not per route), in emit order."""
        seen: dict[Any, str] = {}
        for row in self.messages():
            seen.setdefault(row.event_id, row.event_type)
        return list(seen.values())

    def payloads(self, event_type: str) -> list[Any]:
        """The payload of each ``event_type`` event, in emit order (as stored for its first route)."""
        seen: dict[Any, Any] = {}
        for row in self.messages(event_type=event_type):
            seen.setdefault(row.event_id, row.payload)
        return list(seen.values())

    def assert_emitted(
        self,
        event_type: str,
        *,
        payload: Mapping[str, Any] | None = None,
        key: str | None = None,
        count: int | None = None,
    ) -> list[Row[Any]]:
        """Assert events of ``event_type`` are there (``payload`` and ``key`` must match exactly, if given).

        ``count`` counts events, not routes. Returns the matching rows.
        """
        rows = [
            r
            for r in self.messages(event_type=event_type)
            if (payload is None or r.payload == dict(payload)) and (key is None or r.idempotency_key == key)
        ]
        events = {r.event_id for r in rows}
        if not events or (count is not None and len(events) != count):
            wanted = f"{count if count is not None else 'some'} {event_type!r} event(s)"
            if payload is not None:
                wanted += f" with payload {dict(payload)!r}"
            if key is not None:
                wanted += f" with key {key!r}"
            raise AssertionError(
                f"expected {wanted}, found {len(events)}; {self._seen} event types: {self.event_types()}"
                + self._more_about(event_type)
            )
        return rows

    def assert_nothing_emitted(self) -> None:
        found = self.event_types()
        if found:
            raise AssertionError(f"expected no {self._seen} events, found {found}")

    def _more_about(self, event_type: str) -> str:
        """Anything else a failure message about ``event_type`` should say."""
        return ""


class Recording(RowAssertions):
    """The messages committed since the ``recording()`` block began."""

    def __init__(self, bind: Bind) -> None:
        self._bind = bind
        with committed(bind) as conn:
            self.start_id: int = conn.execute(
                select(func.coalesce(func.max(outbox_message.c.id), 0))
            ).scalar_one()

    def messages(self, **columns: Any) -> list[Row[Any]]:
        return messages(self._bind, after_id=self.start_id, **columns)


@contextmanager
def recording(bind: Bind) -> Iterator[Recording]:
    """Record the outbox messages committed inside the block (and after it, until you look)."""
    yield Recording(bind)
