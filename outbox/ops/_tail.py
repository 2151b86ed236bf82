"""Following the history as it is written: what ``outbox tail`` prints.

History is read by id, ``WHERE id > last``, every ``interval`` seconds. No
trigger is added for it: a per-row trigger on ``outbox_attempt`` would cost
every attempt the relay records, for the sake of an occasional watcher. The
existing NOTIFY announces new messages, not attempts, so it would not say when
to look either.

Ids are handed out when a row is inserted but become visible when its
transaction commits, and on PostgreSQL two transactions may commit in the other
order. An id skipped over is therefore remembered for a while (``GAP_GRACE``)
and looked up again on every poll, so a row committed late is still shown,
after the rows that overtook it. An id that never appears (its transaction
rolled back) is forgotten after that time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Select, Text, cast, func, literal, select
from sqlalchemy.engine import Connection, Engine, Row

from .._redact import Redactor
from .._tables import outbox_attempt, outbox_message
from ._base import decoded

__all__ = ["GAP_GRACE", "HistoryEntry", "HistoryFilter", "follow_history"]

a, m = outbox_attempt, outbox_message

#: How long an id skipped over is looked for again before it counts as rolled back.
GAP_GRACE: Final = 30.0
#: Skipped ids remembered at most; the oldest are forgotten first.
MAX_GAPS: Final = 1000
#: Rows read per query.
PAGE: Final = 500


@dataclass(frozen=True, slots=True)
class HistoryFilter:
    """Which history rows to show; every field optional, all must hold.

    ``handler``, ``event_type`` and ``queue`` are the message's (a row whose
    message was purged has none, and matches only when none is given).
    """

    handler: str | None = None
    event_type: str | None = None
    queue: str | None = None
    outcomes: Sequence[str] = ()
    message_id: int | None = None

    def matches(self, entry: HistoryEntry) -> bool:
        return (
            (self.handler is None or entry.handler == self.handler)
            and (self.event_type is None or entry.event_type == self.event_type)
            and (self.queue is None or entry.queue == self.queue)
            and (not self.outcomes or entry.outcome in self.outcomes)
            and (self.message_id is None or entry.message_id == self.message_id)
        )


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One ``outbox_attempt`` row with its message's route and event type; secrets masked."""

    id: int
    message_id: int
    handler: str | None
    event_type: str | None
    queue: str | None
    attempt: int
    outcome: str
    started_at: datetime
    finished_at: datetime | None
    duration_ms: int | None
    relay_id: str | None
    actor: str | None
    error_type: str | None
    error: str | None
    reason: str | None
    detail: Any = field(default=None)

    @property
    def time(self) -> datetime:
        """When the outcome was reached: ``finished_at``, or ``started_at`` for a row without one."""
        return self.finished_at or self.started_at

    def as_dict(self) -> dict[str, Any]:
        """The keys of ``outbox tail --json``: stable, every one always present (null when unknown)."""
        return {
            "id": self.id,
            "time": _iso(self.time),
            "message_id": self.message_id,
            "handler": self.handler,
            "event_type": self.event_type,
            "queue": self.queue,
            "attempt": self.attempt,
            "outcome": self.outcome,
            "duration_ms": self.duration_ms,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "relay_id": self.relay_id,
            "actor": self.actor,
            "error_type": self.error_type,
            "error": self.error,
            "reason": self.reason,
            "detail": self.detail,
        }


def _query() -> Select[Any]:
    return select(
        a.c.id,
        a.c.message_id,
        m.c.handler,
        m.c.event_type,
        m.c.queue,
        a.c.attempt,
        a.c.outcome,
        a.c.started_at,
        a.c.finished_at,
        a.c.duration_ms,
        a.c.relay_id,
        a.c.actor,
        a.c.error_type,
        a.c.error,
        a.c.reason,
        cast(a.c.detail, Text).label("detail"),  # decoded here, whatever its depth
    ).select_from(a.outerjoin(m, m.c.id == a.c.message_id))


class _Cursor:
    """The highest id shown so far, and the ids below it that may still commit."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.gaps: dict[int, float] = {}  # id -> when it was first skipped (monotonic clock)

    def skip(self, low: int, high: int, now: float) -> None:
        """Ids from ``low`` to ``high`` were not there when a higher one was."""
        for missing in range(max(low, high - MAX_GAPS + 1), high + 1):
            self.gaps.setdefault(missing, now)
        while len(self.gaps) > MAX_GAPS:
            del self.gaps[min(self.gaps)]

    def read(self, conn: Connection) -> list[Row[Any]]:
        now = time.monotonic()
        self.gaps = {i: t for i, t in self.gaps.items() if now - t < GAP_GRACE}
        late = (
            list(conn.execute(_query().where(a.c.id.in_(list(self.gaps))).order_by(a.c.id)))
            if self.gaps
            else []
        )
        for row in late:
            self.gaps.pop(row.id, None)
        new = list(conn.execute(_query().where(a.c.id > self.after).order_by(a.c.id).limit(PAGE)))
        for row in new:
            if row.id > self.after + 1:
                self.skip(self.after + 1, row.id - 1, now)
            self.after = row.id
        return late + new


def _entry(row: Row[Any], redactor: Redactor) -> HistoryEntry:
    values: Mapping[str, Any] = dict(row._mapping)
    return HistoryEntry(
        **{
            **values,
            "error": None if values["error"] is None else redactor.text(values["error"]),
            "reason": None if values["reason"] is None else redactor.text(values["reason"]),
            "detail": redactor.value(decoded(values["detail"])),
        }
    )


def _start(conn: Connection, since: datetime | None, last: int) -> tuple[_Cursor, list[Row[Any]]]:
    """Where to start, and the rows to show first."""
    newest = conn.execute(select(func.max(a.c.id))).scalar_one() or 0
    if since is not None:
        first = conn.execute(
            select(func.min(a.c.id)).where(a.c.started_at >= literal(since, a.c.started_at.type))
        ).scalar_one()
        return _Cursor((first or newest + 1) - 1), []
    cursor = _Cursor(newest)
    # Rows with an id below the newest may still commit: look for them like for any skipped id.
    present = set(conn.execute(select(a.c.id).where(a.c.id > newest - 100)).scalars())
    for missing in range(max(1, newest - 99), newest + 1):
        if missing not in present:
            cursor.skip(missing, missing, time.monotonic())
    if last < 1:
        return cursor, []
    shown = list(conn.execute(_query().order_by(a.c.id.desc()).limit(last)))
    return cursor, shown[::-1]


def follow_history(
    engine: Engine,
    where: HistoryFilter | None = None,
    *,
    since: datetime | None = None,
    last: int = 0,
    interval: float = 0.5,
    secrets: Sequence[str] = (),
    ready: Callable[[], object] | None = None,
) -> Iterator[HistoryEntry]:
    """History rows as they are written, oldest first, forever: stop by leaving the loop.

    Starts after the newest row (nothing old is shown), or with the ``last``
    newest rows, or with the first row that started at or after ``since``.
    Looks for new rows every ``interval`` seconds while there are none. Error
    texts and reasons have ``secrets`` masked, and ``detail`` keys that name a
    secret, as ``outbox show`` does. ``ready`` is called once the starting
    point is fixed: rows committed after that call are not missed.
    """
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval!r}")
    filtered = where or HistoryFilter()
    redactor = Redactor(secrets)
    with engine.connect() as conn:
        cursor, first = _start(conn, since, last)
    if ready is not None:
        ready()
    for row in first:
        entry = _entry(row, redactor)
        if filtered.matches(entry):
            yield entry
    while True:
        with engine.connect() as conn:
            rows = cursor.read(conn)
        for row in rows:
            entry = _entry(row, redactor)
            if filtered.matches(entry):
                yield entry
        if len(rows) < PAGE:
            time.sleep(interval)
