"""Reads a dashboard polls: capped counts, the status breakdown, per-minute activity, copy lineage.

They live in ``outbox.ops`` so the command line and any web dashboard show
the same figures from the same queries. Each is meant to be called on every
page load against a big table, so each is bounded: counts stop at a cap,
activity reads only the window's history through ``ix_outbox_attempt_started_at``
and aggregates it in the database, lineage walks ``requeued_from`` through its
index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import BigInteger, ColumnElement, Text, and_, case, cast, func, literal, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

from .._tables import MESSAGE_STATUSES, status_is_one_of
from ._base import InvalidRequest, NotFound, _has_copy, _now, a, decoded, m
from ._filters import MessageFilter

__all__ = [
    "ACTIVITY_RETRIED",
    "MAX_ACTIVITY_MINUTES",
    "CappedCount",
    "Lineage",
    "LineageCopy",
    "MinuteActivity",
    "QueueHandlerCount",
    "activity",
    "breakdown",
    "count_messages",
    "lineage",
]

#: History outcomes a dashboard shows as "retried": attempts that failed but left the message alive.
ACTIVITY_RETRIED: Final = ("retry", "failed", "timeout", "lease_expired")
#: A day: the zero-filled series is built in memory, and longer views belong to a metrics system.
MAX_ACTIVITY_MINUTES: Final = 1440


def _whole(value: Any, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        bound = f"from {low} to {high}" if high else f"at least {low}"
        raise InvalidRequest(f"{name} must be a whole number {bound}, got {value!r}")
    return value


# -- counts ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CappedCount:
    """How many messages match, up to a cap. ``capped``: more than ``count`` match (show "10,000+")."""

    count: int
    capped: bool


def count_messages(engine: Engine, where: MessageFilter | None = None, *, cap: int = 10_000) -> CappedCount:
    """Matching messages, counted no further than ``cap``.

    An exact count of a broad filter reads every matching row, which on a big
    table is seconds per page load; past the cap a dashboard only needs "more
    than". The inner ``LIMIT cap + 1`` lets the database stop early.
    """
    _whole(cap, "cap", 1)
    matching = (where or MessageFilter()).apply(select(m.c.id)).limit(cap + 1).subquery()
    with engine.connect() as conn:
        found = int(conn.execute(select(func.count()).select_from(matching)).scalar_one())
    return CappedCount(count=min(found, cap), capped=found > cap)


@dataclass(frozen=True, slots=True)
class QueueHandlerCount:
    queue: str
    handler: str
    status: str
    count: int
    #: the oldest ``created_at`` among them: how long the oldest has been waiting, for unfinished ones
    oldest_created_at: datetime | None = None
    #: for ``dead``: how many already have a requeued copy (the rest wait for an operator)
    requeued: int = 0


def breakdown(engine: Engine, *, statuses: Sequence[str] | None = None) -> list[QueueHandlerCount]:
    """Messages by queue, handler and status, sorted by those three: the overview's table.

    Every row is counted as stored (a requeued original stays ``dead``; see
    :class:`Stats` for the dead figure net of requeues). Counting every row is
    a full scan, about 150-200 ms per million rows on PostgreSQL, almost all of
    it delivered messages; ``statuses`` (e.g. all but ``delivered``) limits the
    count to those, through ``ix_outbox_message_status_handler``, for a page that
    must load faster than that.
    """
    # One pass over the rows gives every figure the overview shows for them; the copy
    # lookup (ix_outbox_message_requeued_from) runs for dead rows only.
    requeued = func.coalesce(func.sum(case((and_(m.c.status == "dead", _has_copy()), 1), else_=0)), 0)
    stmt = select(
        m.c.queue, m.c.handler, m.c.status, func.count(), func.min(m.c.created_at), requeued
    ).group_by(m.c.queue, m.c.handler, m.c.status)
    if statuses is not None:
        unknown = sorted(set(statuses) - set(MESSAGE_STATUSES))
        if isinstance(statuses, str) or unknown:
            raise InvalidRequest(f"statuses must be some of {', '.join(MESSAGE_STATUSES)}, got {statuses!r}")
        if not statuses:
            return []
        stmt = stmt.where(status_is_one_of(*sorted(set(statuses))))
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    return [
        QueueHandlerCount(q, h, s, int(n), oldest, int(copied))
        for q, h, s, n, oldest, copied in sorted(rows, key=lambda r: tuple(r[:3]))
    ]


# -- activity ---------------------------------------------------------------------------------------


class _EpochMinute(ColumnElement[int]):
    """Whole minutes since 1970 of a UTC timestamp column: a bucket both databases can group by.

    ``date_trunc`` is PostgreSQL's and ``strftime`` SQLite's; an integer is
    what both can produce, and Python turns it back into a datetime.
    """

    inherit_cache = True
    type = BigInteger()

    def __init__(self, column: ColumnElement[Any]) -> None:
        self.column = column


@compiles(_EpochMinute, "postgresql")
def _epoch_minute_postgresql(element: _EpochMinute, compiler: SQLCompiler, **kw: Any) -> str:
    return f"CAST(floor(extract(epoch FROM {compiler.process(element.column, **kw)}) / 60) AS BIGINT)"


@compiles(_EpochMinute)
def _epoch_minute_sqlite(element: _EpochMinute, compiler: SQLCompiler, **kw: Any) -> str:
    # UTCDateTime keeps naive UTC text on SQLite, which strftime reads as UTC.
    return f"(CAST(strftime('%s', {compiler.process(element.column, **kw)}) AS INTEGER) / 60)"


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class MinuteActivity:
    """One minute of history. ``retried``: outcomes in :data:`ACTIVITY_RETRIED`; ``died``: ``dead``.

    ``expired``: messages claimed past their ``expires_at`` and discarded unseen.
    """

    minute: datetime  # its start, aware UTC
    delivered: int = 0
    retried: int = 0
    died: int = 0
    expired: int = 0


def activity(engine: Engine, *, minutes: int = 60) -> list[MinuteActivity]:
    """Deliveries, retries, deaths and expiries per minute, oldest first, ending with the current minute.

    Minutes without history are present with zeros, so a chart's x axis is the
    list as given. Counting happens in the database, grouped by minute and
    outcome, over the window's rows of ``ix_outbox_attempt_started_at``: at most
    ``minutes`` × outcomes rows come back however busy the relays were.
    """
    _whole(minutes, "minutes", 1, MAX_ACTIVITY_MINUTES)
    now = _now()
    last = int((now - _EPOCH).total_seconds() // 60)
    first = last - minutes + 1
    start = _EPOCH + timedelta(minutes=first)
    bucket = _EpochMinute(a.c.started_at)
    stmt = (
        select(bucket, a.c.outcome, func.count())
        .where(
            a.c.started_at >= literal(start, a.c.started_at.type),
            a.c.outcome.in_(("delivered", "dead", "expired", *ACTIVITY_RETRIED)),
        )
        .group_by(bucket, a.c.outcome)
    )
    counts: dict[int, dict[str, int]] = {}
    with engine.connect() as conn:
        for minute, outcome, count in conn.execute(stmt):
            if first <= minute <= last:  # a relay's clock ahead of ours: not on this chart yet
                per = counts.setdefault(int(minute), {})
                per[outcome] = per.get(outcome, 0) + int(count)
    series = []
    for minute in range(first, last + 1):
        per = counts.get(minute, {})
        series.append(
            MinuteActivity(
                minute=_EPOCH + timedelta(minutes=minute),
                delivered=per.get("delivered", 0),
                retried=sum(per.get(o, 0) for o in ACTIVITY_RETRIED),
                died=per.get("dead", 0),
                expired=per.get("expired", 0),
            )
        )
    return series


# -- lineage ----------------------------------------------------------------------------------------


#: How a copy was made from the message it points at: the outcome of the history row naming it.
COPY_OUTCOMES: Final = ("requeued", "resent")


@dataclass(frozen=True, slots=True)
class LineageCopy:
    id: int
    status: str
    requeued_from: int
    #: ``requeued`` or ``resent``: the outcome of the history row on ``requeued_from`` that names
    #: this copy; ``copied`` when that row was purged.
    made_by: str = "requeued"


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a message came from and what was made of it, through requeues and resends.

    ``ancestors`` runs from the original down to the direct parent (empty for
    an original); ``made_by`` says how the message was made from its parent
    (as :class:`LineageCopy` does; None for an original). ``descendants`` are
    the copies made from it, their copies and so on, in id order (creation
    order); each names its parent, so a tree can be drawn when one message
    was copied more than once.
    """

    message_id: int
    ancestors: list[int]
    descendants: list[LineageCopy]
    made_by: str | None = None


def lineage(engine: Engine, message_id: int) -> Lineage:
    """Both directions in two recursive queries, each step one lookup by key or by
    ``ix_outbox_message_requeued_from``, and one read of the parents' copying history rows.

    A copy always has a higher id than its parent (it is inserted after it), and
    both walks insist on that, so a hand-edited cycle cannot make them loop.
    """
    up = select(m.c.id, m.c.requeued_from).where(m.c.id == message_id).cte("lineage_up", recursive=True)
    parent = m.alias("parent")
    up = up.union_all(
        select(parent.c.id, parent.c.requeued_from).where(
            parent.c.id == up.c.requeued_from, parent.c.id < up.c.id
        )
    )
    down = (
        select(m.c.id, m.c.status, m.c.requeued_from)
        .where(m.c.requeued_from == message_id, m.c.id > message_id)
        .cte("lineage_down", recursive=True)
    )
    child = m.alias("child")
    down = down.union_all(
        select(child.c.id, child.c.status, child.c.requeued_from).where(
            child.c.requeued_from == down.c.id, child.c.id > down.c.id
        )
    )
    with engine.connect() as conn:
        chain = [row.id for row in conn.execute(select(up.c.id).order_by(up.c.id))]
        if message_id not in chain:
            raise NotFound(f"no message with id {message_id}")
        found = conn.execute(select(down).order_by(down.c.id)).all()
        ancestors = [i for i in chain if i != message_id]
        parents = {row.requeued_from for row in found} | set(ancestors[-1:])
        made = _copies_made(conn, parents)
    copies = [LineageCopy(r.id, r.status, r.requeued_from, made.get(r.id, "copied")) for r in found]
    made_by = made.get(message_id, "copied") if ancestors else None
    return Lineage(message_id=message_id, ancestors=ancestors, descendants=copies, made_by=made_by)


def _copies_made(conn: Connection, parents: set[int]) -> dict[int, str]:
    """Copy id → ``requeued`` or ``resent``, from the history rows of ``parents`` that name a copy."""
    if not parents:
        return {}
    rows = conn.execute(
        select(a.c.outcome, cast(a.c.detail, Text).label("detail")).where(
            a.c.message_id.in_(sorted(parents)), a.c.outcome.in_(COPY_OUTCOMES)
        )
    )
    made: dict[int, str] = {}
    for row in rows:
        detail = decoded(row.detail)
        new_id = detail.get("new_id") if isinstance(detail, dict) else None
        if isinstance(new_id, int):
            made[new_id] = row.outcome
    return made
