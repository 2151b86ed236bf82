"""Operations on stored messages: stats, listing, inspection, requeue, discard, retry-now, retention.

The ``outbox`` command and any dashboard call these. Every action that changes
what will happen to a message appends a history row naming the actor and the
reason; a dead message is never edited (requeue makes a new message that
points back at it), so the audit trail stays complete.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Select,
    and_,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from ._exceptions import OutboxError
from ._redact import Redactor
from ._retention import history_purge_allowed
from ._tables import outbox_attempt, outbox_message, outbox_retention_run
from ._tail import HistoryEntry, HistoryFilter, follow_history
from ._where import PayloadEquals, WhereError, parse_where

__all__ = [
    "MAX_PURGE_BATCH",
    "MIN_HISTORY_AGE",
    "HistoryEntry",
    "HistoryFilter",
    "MessageFilter",
    "NotFound",
    "OpsError",
    "PayloadEquals",
    "PurgeResult",
    "Stats",
    "WhereError",
    "count_candidates",
    "discard",
    "follow_history",
    "list_messages",
    "parse_duration",
    "parse_where",
    "purge",
    "requeue",
    "requeue_candidates",
    "requeued_key",
    "retry_now",
    "show",
    "stats",
]

m = outbox_message
a = outbox_attempt
run = outbox_retention_run

REQUEUABLE = ("dead", "discarded")
DISCARDABLE = ("pending", "dead")
#: The idempotency_key column's width.
KEY_LIMIT = 255
#: Messages a filter-based requeue or discard reads, locks and changes per transaction.
ACTION_BATCH = 500


class OpsError(OutboxError):
    """An operation was asked for something it must refuse (wrong status, bad filter, bad duration)."""


class NotFound(OpsError):
    """No message has the given id."""


def _now() -> datetime:
    return datetime.now(UTC)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` → timedelta; anything else is refused."""
    match = _DURATION.match(text)
    if not match:
        raise OpsError(f"bad duration {text!r}: use a number and one of s, m, h, d, w (e.g. 30d)")
    try:
        return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    except (OverflowError, ValueError):  # past timedelta's 999,999,999 days, or inf
        raise OpsError(f"duration {text!r} is too long: at most 999999999d") from None


def _before(now: datetime, age: timedelta, what: str) -> datetime:
    """``now - age``, refused in one line when it would fall before year 1."""
    try:
        return now - age
    except OverflowError:
        raise OpsError(f"{what} {age.days}d reaches back before year 1; give a shorter age") from None


# -- reading ----------------------------------------------------------------------------


def _has_copy() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row that a requeued copy points at (ix_outbox_message_requeued_from)."""
    copy = m.alias("requeued_copy")
    return select(copy.c.id).where(copy.c.requeued_from == m.c.id).exists()


@dataclass(frozen=True, slots=True)
class Stats:
    """What ``outbox stats`` shows.

    ``by_status`` counts rows as stored. A requeued original stays ``dead`` for
    the record, so ``dead`` counts only dead messages nobody has acted on yet
    (no copy points back at them): the figure to alert on, which goes down
    when an operator requeues. ``dead_requeued`` counts the others; the two add
    up to ``by_status["dead"]``.
    """

    by_status: dict[str, int]
    by_handler_status: dict[str, dict[str, int]]
    oldest_pending_age_s: dict[str, float]  # per queue: due pending messages, from available_at
    delivered_last_hour: int
    failed_last_hour: int  # attempts that did not deliver (retry, failed, timeout, dead, lease_expired)
    dead: int  # dead and not requeued: waiting for an operator
    dead_requeued: int = 0  # dead, with a requeued copy
    # per queue: pending (due or not, retries included) or running messages, from created_at
    oldest_unfinished_age_s: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "by_status": self.by_status,
            "by_handler_status": self.by_handler_status,
            "oldest_pending_age_s": self.oldest_pending_age_s,
            "oldest_unfinished_age_s": self.oldest_unfinished_age_s,
            "delivered_last_hour": self.delivered_last_hour,
            "failed_last_hour": self.failed_last_hour,
            "dead": self.dead,
            "dead_requeued": self.dead_requeued,
        }


def stats(engine: Engine) -> Stats:
    now = _now()
    hour_ago = now - timedelta(hours=1)
    with engine.connect() as conn:
        by_handler: dict[str, dict[str, int]] = {}
        by_status: dict[str, int] = {}
        for handler, status, count in conn.execute(
            select(m.c.handler, m.c.status, func.count()).group_by(m.c.handler, m.c.status)
        ):
            by_handler.setdefault(handler, {})[status] = count
            by_status[status] = by_status.get(status, 0) + count
        oldest = {
            queue: max(0.0, (now - first).total_seconds())
            for queue, first in conn.execute(
                select(m.c.queue, func.min(m.c.available_at))
                .where(m.c.status == "pending", m.c.available_at <= literal(now, m.c.available_at.type))
                .group_by(m.c.queue)
            )
            if first is not None
        }
        unfinished = {
            queue: max(0.0, (now - first).total_seconds())
            for queue, first in conn.execute(
                select(m.c.queue, func.min(m.c.created_at))
                .where(m.c.status.in_(("pending", "running")))
                .group_by(m.c.queue)
            )
            if first is not None
        }
        # One statement, so the two figures add up even while an operator requeues.
        dead_total, dead_requeued = conn.execute(
            select(func.count(), func.coalesce(func.sum(case((_has_copy(), 1), else_=0)), 0)).where(
                m.c.status == "dead"
            )
        ).one()
        outcomes: dict[str, int] = dict(
            conn.execute(
                select(a.c.outcome, func.count())
                .where(a.c.started_at >= literal(hour_ago, a.c.started_at.type))
                .group_by(a.c.outcome)
            ).all()
        )
    failed = sum(outcomes.get(o, 0) for o in ("retry", "failed", "timeout", "dead", "lease_expired"))
    return Stats(
        by_status=by_status,
        by_handler_status=by_handler,
        oldest_pending_age_s=oldest,
        delivered_last_hour=outcomes.get("delivered", 0),
        failed_last_hour=failed,
        dead=dead_total - dead_requeued,
        dead_requeued=dead_requeued,
        oldest_unfinished_age_s=unfinished,
    )


@dataclass(frozen=True, slots=True)
class MessageFilter:
    """Equality filters plus a created-at window; every field optional, all of them must hold.

    ``payload`` holds conditions on values inside the payload
    (:func:`parse_where` reads the command line's ``payload.PATH=VALUE``).
    """

    status: str | None = None
    handler: str | None = None
    event_type: str | None = None
    queue: str | None = None
    key: str | None = None
    group_key: str | None = None
    created_since: datetime | None = None
    created_before: datetime | None = None
    ids: Sequence[int] = field(default_factory=tuple)
    payload: Sequence[PayloadEquals] = field(default_factory=tuple)

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        from ._tables import MESSAGE_STATUSES

        if self.status is not None and self.status not in MESSAGE_STATUSES:
            raise OpsError(f"unknown status {self.status!r}; one of {', '.join(MESSAGE_STATUSES)}")
        for column, value in (
            (m.c.status, self.status),
            (m.c.handler, self.handler),
            (m.c.event_type, self.event_type),
            (m.c.queue, self.queue),
            (m.c.idempotency_key, self.key),
            (m.c.group_key, self.group_key),
        ):
            if value is not None:
                stmt = stmt.where(column == value)
        if self.created_since is not None:
            stmt = stmt.where(m.c.created_at >= literal(self.created_since, m.c.created_at.type))
        if self.created_before is not None:
            stmt = stmt.where(m.c.created_at < literal(self.created_before, m.c.created_at.type))
        if self.ids:
            stmt = stmt.where(m.c.id.in_(list(self.ids)))
        for condition in self.payload:
            stmt = stmt.where(condition.condition())
        return stmt

    @property
    def empty(self) -> bool:
        return not (
            self.ids
            or self.payload
            or any(
                v is not None
                for v in (
                    self.status,
                    self.handler,
                    self.event_type,
                    self.queue,
                    self.key,
                    self.group_key,
                    self.created_since,
                    self.created_before,
                )
            )
        )


def list_messages(
    engine: Engine, where: MessageFilter | None = None, *, limit: int = 50, before_id: int | None = None
) -> list[Row[Any]]:
    """Newest first. Page with ``before_id`` = the last id of the previous page (stable under inserts)."""
    if limit < 1:
        raise OpsError(f"limit must be at least 1, got {limit}")
    stmt = (where or MessageFilter()).apply(
        select(
            m.c.id,
            m.c.event_type,
            m.c.handler,
            m.c.queue,
            m.c.status,
            m.c.attempts,
            m.c.max_attempts,
            m.c.idempotency_key,
            m.c.group_key,
            m.c.created_at,
            m.c.available_at,
            m.c.last_error,
            m.c.requeued_from,
        )
    )
    if before_id is not None:
        stmt = stmt.where(m.c.id < before_id)
    with engine.connect() as conn:
        return list(conn.execute(stmt.order_by(m.c.id.desc()).limit(limit)))


@dataclass(frozen=True, slots=True)
class MessageHistory:
    message: dict[str, Any]
    attempts: list[dict[str, Any]]


def show(engine: Engine, message_id: int, *, secrets: Iterable[str] = ()) -> MessageHistory:
    """A message (payload and headers with secret-looking fields masked) and its attempts in order."""
    redactor = Redactor(secrets)
    with engine.connect() as conn:
        row = conn.execute(select(m).where(m.c.id == message_id)).first()
        if row is None:
            raise NotFound(f"no message with id {message_id}")
        attempts = list(conn.execute(select(a).where(a.c.message_id == message_id).order_by(a.c.id)))
    message = dict(row._mapping)
    message["payload"] = redactor.value(message["payload"])
    message["headers"] = redactor.value(message["headers"])
    return MessageHistory(message=message, attempts=[dict(r._mapping) for r in attempts])


# -- acting ---------------------------------------------------------------------------------


def _check_reason(reason: str, actor: str) -> None:
    if not isinstance(reason, str) or not reason.strip():
        raise OpsError("a reason is required: it is what the audit trail will say")
    if not isinstance(actor, str) or not actor.strip():
        raise OpsError("an actor is required")


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise OpsError(f"batch_size must be a whole number of at least 1, got {batch_size!r}")


def _named(
    conn: Connection, where: MessageFilter, allowed: tuple[str, ...], verb: str, columns: Sequence[Any]
) -> list[Row[Any]]:
    """The rows of named ids, locked; every id must exist and have an allowed status, or none is acted on.

    The statuses are checked without a lock, and only rows in an allowed status
    are locked: a running message belongs to a relay, which must never wait for
    an operator's refused command.
    """
    found: dict[int, str] = {r.id: r.status for r in conn.execute(where.apply(select(m.c.id, m.c.status)))}
    missing = [i for i in where.ids if i not in found]
    if missing:
        raise NotFound(f"no message with id {', '.join(map(str, missing))}")
    wrong = sorted((i, s) for i, s in found.items() if s not in allowed)
    if wrong:
        listed = ", ".join(f"{i} ({s})" for i, s in wrong)
        raise OpsError(f"can only {verb} {' or '.join(allowed)} messages; not {listed}")
    stmt = where.apply(select(*columns)).where(m.c.status.in_(allowed)).order_by(m.c.id)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    rows = list(conn.execute(stmt))
    changed = sorted(set(found) - {r.id for r in rows})
    if changed:  # a relay claimed it, or another operator acted, between the two reads
        raise OpsError(f"message {', '.join(map(str, changed))} changed status meanwhile; try again")
    return rows


def _filtered_batches(
    engine: Engine,
    where: MessageFilter,
    allowed: tuple[str, ...],
    verb: str,
    columns: Sequence[Any],
    batch_size: int,
    *extra: ColumnElement[bool],
) -> Iterator[tuple[Connection, list[Row[Any]]]]:
    """Rows a filter matches in an allowed status, ``batch_size`` at a time, a transaction each.

    The status condition is part of the query, so rows in any other status
    (running ones above all: they belong to a relay) are neither loaded nor
    locked. Each batch is committed before the next is read, so no lock is held
    for long and memory stays bounded however many rows match.
    """
    if where.empty:
        raise OpsError(f"refusing to {verb} every message: give ids or a filter")
    after = 0
    while True:
        with engine.begin() as conn:
            stmt = (
                where.apply(select(*columns))
                .where(m.c.status.in_(allowed), m.c.id > after, *extra)
                .order_by(m.c.id)
                .limit(batch_size)
            )
            if conn.dialect.name == "postgresql":
                stmt = stmt.with_for_update()
            rows = list(conn.execute(stmt))
            if not rows:
                return
            yield conn, rows
        after = rows[-1].id


def _requeued_as(conn: Connection, ids: Sequence[int]) -> dict[int, int]:
    """Old id → id of its newest copy, for those of ``ids`` that were requeued before."""
    if not ids:
        return {}
    return {
        old: new
        for old, new in conn.execute(
            select(m.c.requeued_from, func.max(m.c.id))
            .where(m.c.requeued_from.in_(list(ids)))
            .group_by(m.c.requeued_from)
        )
    }


def _candidates(where: MessageFilter, verb: str, include_delayed: bool = False) -> Select[Any]:
    if where.empty:
        raise OpsError(f"refusing to {verb} every message: give ids or a filter")
    if verb == "requeue":
        return where.apply(select(m.c.id)).where(m.c.status.in_(REQUEUABLE), ~_has_copy())
    if verb == "discard":
        return where.apply(select(m.c.id)).where(m.c.status.in_(DISCARDABLE))
    if verb in ("retry-now", "retry_now"):
        return where.apply(select(m.c.id)).where(*_waiting(_now(), include_delayed))
    raise OpsError(f"unknown action {verb!r}; one of requeue, discard, retry-now")


def requeue_candidates(engine: Engine, where: MessageFilter) -> list[int]:
    """The ids a filter-based :func:`requeue` would copy now."""
    with engine.connect() as conn:
        return list(conn.execute(_candidates(where, "requeue").order_by(m.c.id)).scalars())


def count_candidates(
    engine: Engine, where: MessageFilter, verb: str, *, include_delayed: bool = False
) -> int:
    """How many messages a filter-based ``requeue``, ``discard`` or ``retry-now`` (``verb``) would act on now.

    What a confirmation prompt counts, without loading the rows.
    ``include_delayed`` is :func:`retry_now`'s.
    """
    candidates = _candidates(where, verb, include_delayed).subquery()
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(candidates)).scalar_one())


def _record_action(
    conn: Connection, old: Row[Any], outcome: str, actor: str, reason: str, now: datetime, **detail: Any
) -> None:
    """An operator's action as a history row on the message it acted on."""
    conn.execute(
        insert(a).values(
            message_id=old.id,
            attempt=old.attempts,
            outcome=outcome,
            started_at=now,
            finished_at=now,
            duration_ms=0,
            actor=actor,
            reason=reason,
            detail={**detail, "previous_status": old.status},
        )
    )


def requeued_key(key: str | None, old_id: int) -> str | None:
    """The idempotency key of the requeued copy of message ``old_id`` whose key is ``key``.

    ``<key>~requeue:<old id>``; when that would not fit the column, ``key`` is
    shortened from its end, never the suffix. The suffix names the message
    copied, and a message is copied at most once, so the copy's key is unique
    for its route (it never equals the original's), and a copy of a copy gets
    its own suffix in turn.
    """
    if key is None:
        return None
    suffix = f"~requeue:{old_id}"
    return key[: KEY_LIMIT - len(suffix)] + suffix


def _copy(conn: Connection, old: Row[Any], actor: str, reason: str, now: datetime) -> int:
    new_id: int = conn.execute(
        insert(m)
        .values(
            event_id=old.event_id,
            event_type=old.event_type,
            handler=old.handler,
            queue=old.queue,
            priority=old.priority,
            payload=old.payload,
            headers=old.headers,
            aggregate_type=old.aggregate_type,
            aggregate_id=old.aggregate_id,
            idempotency_key=requeued_key(old.idempotency_key, old.id),
            group_key=old.group_key,
            status="pending",
            attempts=0,
            max_attempts=old.max_attempts,
            available_at=now,
            created_at=now,
            updated_at=now,
            requeued_from=old.id,
        )
        .returning(m.c.id)
    ).scalar_one()
    _record_action(conn, old, "requeued", actor, reason, now, new_id=new_id)
    return new_id


def requeue(
    engine: Engine, where: MessageFilter, *, reason: str, actor: str, batch_size: int = ACTION_BATCH
) -> list[tuple[int, int]]:
    """Give dead (or discarded) messages a fresh start as new messages; returns (old id, new id) pairs.

    The old row is not touched: a ``requeued`` history row on it names the
    actor, the reason and the new id. The copy keeps the event id, payload,
    route, group and aggregate; its idempotency key gains a ``~requeue:<old id>``
    suffix (see :func:`requeued_key`), because (route, key) is unique and the
    old row still holds the key.

    A message is requeued at most once, because the old row stays dead and a
    second copy would deliver the event twice: named ids that already have a
    copy are refused (requeue the copy if it failed too), a filter skips them.

    Named ids are acted on in one transaction, all or none. A filter works in
    batches of ``batch_size`` messages, each its own transaction; it never
    reads, locks or changes a message in any other status than dead or
    discarded.
    """
    _check_reason(reason, actor)
    _check_batch_size(batch_size)
    now = _now()
    pairs: list[tuple[int, int]] = []
    if where.ids:
        with engine.begin() as conn:
            targets = _named(conn, where, REQUEUABLE, "requeue", [m])
            copied = _requeued_as(conn, [r.id for r in targets])
            if copied:
                listed = ", ".join(f"{old} (as {new})" for old, new in sorted(copied.items()))
                raise OpsError(f"already requeued: {listed}; if a copy failed too, requeue the copy")
            pairs = [(old.id, _copy(conn, old, actor, reason, now)) for old in targets]
        return pairs
    for conn, batch in _filtered_batches(engine, where, REQUEUABLE, "requeue", [m], batch_size, ~_has_copy()):
        # Read again under the lock: a concurrent requeue may have committed a copy since the query began.
        copied = _requeued_as(conn, [r.id for r in batch])
        pairs += [(old.id, _copy(conn, old, actor, reason, now)) for old in batch if old.id not in copied]
    return pairs


def _discard_one(conn: Connection, old: Row[Any], actor: str, reason: str, now: datetime) -> bool:
    changed = conn.execute(
        update(m)
        .where(m.c.id == old.id, m.c.status.in_(DISCARDABLE))
        .values(status="discarded", updated_at=now, locked_by=None, locked_until=None)
    ).rowcount
    if changed:
        _record_action(conn, old, "discarded", actor, reason, now)
    return bool(changed)


def discard(
    engine: Engine, where: MessageFilter, *, reason: str, actor: str, batch_size: int = ACTION_BATCH
) -> list[int]:
    """Mark pending or dead messages as no longer wanted; each gets a ``discarded`` history row.

    Named ids are acted on in one transaction, all or none; a filter works in
    batches of ``batch_size``, each its own transaction, and never reads, locks
    or changes a running message (it belongs to a relay).
    """
    _check_reason(reason, actor)
    _check_batch_size(batch_size)
    now = _now()
    columns = [m.c.id, m.c.status, m.c.attempts]
    if where.ids:
        with engine.begin() as conn:
            return [
                r.id
                for r in _named(conn, where, DISCARDABLE, "discard", columns)
                if _discard_one(conn, r, actor, reason, now)
            ]
    done: list[int] = []
    for conn, batch in _filtered_batches(engine, where, DISCARDABLE, "discard", columns, batch_size):
        done += [r.id for r in batch if _discard_one(conn, r, actor, reason, now)]
    return done


def _tried() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row with history: attempted before (ix_outbox_attempt_message_id)."""
    return select(a.c.id).where(a.c.message_id == m.c.id).exists()


def _waiting(now: datetime, include_delayed: bool) -> list[ColumnElement[bool]]:
    """Pending and not due yet; unless ``include_delayed``, also attempted before (a backoff, not a delay)."""
    waiting = [m.c.status == "pending", m.c.available_at > literal(now, m.c.available_at.type)]
    return waiting if include_delayed else [*waiting, _tried()]


def _make_due(
    conn: Connection, rows: Sequence[Row[Any]], actor: str, reason: str, now: datetime
) -> list[int]:
    """Make those of ``rows`` still waiting due at ``now``, each with a history row; returns their ids."""
    if not rows:
        return []
    due = set(
        conn.execute(
            update(m)
            .where(
                m.c.id.in_([r.id for r in rows]),
                m.c.status == "pending",
                m.c.available_at > literal(now, m.c.available_at.type),
            )
            .values(available_at=now, updated_at=now)
            .returning(m.c.id)
        ).scalars()
    )
    for row in rows:
        if row.id in due:
            due_at = row.available_at.isoformat()
            _record_action(conn, row, "retried_now", actor, reason, now, was_due_at=due_at)
    if due and conn.dialect.name == "postgresql":
        # An UPDATE does not fire the NOTIFY trigger (it is on INSERT): wake the relays ourselves.
        conn.execute(text("SELECT pg_notify('outbox', current_schema())"))
    return sorted(due)


def retry_now(
    engine: Engine,
    where: MessageFilter,
    *,
    reason: str,
    actor: str,
    include_delayed: bool = False,
    batch_size: int = ACTION_BATCH,
) -> list[int]:
    """Make pending messages that wait out a backoff due now; returns their ids, in id order.

    A message a relay attempted before (it has history) and whose
    ``available_at`` lies in the future gets ``available_at`` = now and a
    ``retried_now`` history row naming the actor, the reason and
    ``detail.was_due_at``. Its attempt count, priority, queue and group stay as
    they are: it is the same message, retried sooner. On PostgreSQL the relays
    are woken at once (NOTIFY on the channel they listen on).

    A message emitted with a ``delay`` and never attempted is left alone, since
    someone asked for that delay: ``include_delayed=True`` pulls those forward
    too. Running, delivered, dead and discarded messages, and pending ones
    already due, are never touched.

    Named ids are acted on in one transaction, all or none: each must be
    waiting. A filter works in batches of ``batch_size``, each its own
    transaction, and never reads, locks or changes a message in another status
    than pending.
    """
    _check_reason(reason, actor)
    _check_batch_size(batch_size)
    now = _now()
    columns = [m.c.id, m.c.status, m.c.attempts, m.c.available_at]
    waiting = _waiting(now, include_delayed)
    if where.ids:
        with engine.begin() as conn:
            targets = _named_waiting(conn, where, now, include_delayed, columns)
            done = _make_due(conn, targets, actor, reason, now)
            if len(done) != len(targets):  # SQLite takes no row locks: a relay may have claimed one since
                changed = sorted({r.id for r in targets} - set(done))
                raise OpsError(f"message {', '.join(map(str, changed))} changed meanwhile; try again")
            return done
    acted: list[int] = []
    batches = _filtered_batches(engine, where, ("pending",), "retry-now", columns, batch_size, *waiting)
    for conn, batch in batches:
        acted += _make_due(conn, batch, actor, reason, now)
    return acted


def _named_waiting(
    conn: Connection, where: MessageFilter, now: datetime, include_delayed: bool, columns: Sequence[Any]
) -> list[Row[Any]]:
    """The rows of named ids, locked; each must be waiting (see :func:`retry_now`), or none is acted on.

    As in :func:`_named`, statuses are read without a lock and only waiting rows are locked.
    """
    state = select(m.c.id, m.c.status, m.c.available_at, _tried().label("tried"))
    found = {r.id: r for r in conn.execute(where.apply(state))}
    missing = [i for i in where.ids if i not in found]
    if missing:
        raise NotFound(f"no message with id {', '.join(map(str, missing))}")
    wrong: list[str] = []
    for i, r in sorted(found.items()):
        if r.status != "pending":
            wrong.append(f"{i} ({r.status})")
        elif r.available_at <= now:
            wrong.append(f"{i} (due already)")
        elif not include_delayed and not r.tried:
            wrong.append(f"{i} (delayed at emit, never attempted)")
    if wrong:
        delayed = any("delayed" in w for w in wrong)
        hint = "; include delayed messages to pull those forward" if delayed else ""
        raise OpsError(
            f"can only retry-now pending messages waiting to be retried; not {', '.join(wrong)}{hint}"
        )
    stmt = where.apply(select(*columns)).where(*_waiting(now, include_delayed)).order_by(m.c.id)
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    rows = list(conn.execute(stmt))
    changed = sorted(set(found) - {r.id for r in rows})
    if changed:  # a relay claimed it, or another operator acted, between the two reads
        raise OpsError(f"message {', '.join(map(str, changed))} changed meanwhile; try again")
    return rows


#: The youngest history a purge may delete. On PostgreSQL the purge functions enforce it.
MIN_HISTORY_AGE: Final = timedelta(days=1)
#: The largest batch a purge takes: each batch is one transaction, and these must stay short.
MAX_PURGE_BATCH: Final = 10000


@dataclass(frozen=True, slots=True)
class PurgeResult:
    messages: int
    attempts: int
    batches: int
    run_id: int | None = None  # the purge's outbox_retention_run row


def purge(
    engine: Engine,
    *,
    delivered_older_than: timedelta,
    history_older_than: timedelta | None = None,
    batch_size: int = 1000,
    actor: str = "outbox purge",
    on_batch: Callable[[PurgeResult], None] | None = None,
    history_of_unresolved: bool = False,
) -> PurgeResult:
    """Delete finished messages (delivered or discarded) and, optionally, old history, in small batches.

    Each batch is its own short transaction, so no long lock is held. A
    message's history outlives the message unless ``history_older_than`` also
    removes it; dead messages are never purged (they wait for an operator),
    nor is an original that a requeued copy still points at.

    ``history_older_than`` is at least :data:`MIN_HISTORY_AGE` (one day). The
    history of a message that is still unresolved (pending, running, or dead
    and not requeued) is kept whatever its age: it is what an operator reads to
    decide. ``history_of_unresolved=True`` purges it too, and the run's record
    says so.

    The purge records itself in ``outbox_retention_run``: the row (actor,
    cutoffs) is written before the first batch, each batch adds its counts in
    the same transaction as its deletes, and ``finished_at`` is set after the
    last. An interrupted purge therefore leaves a row with ``finished_at``
    NULL and counts that say exactly what was deleted. ``on_batch`` is called
    after each committed batch with the totals so far (progress reports); an
    exception it raises stops the purge there.

    On PostgreSQL the database does all of that itself, through the functions
    ``outbox_purge_start``, ``outbox_purge_step`` and ``outbox_purge_finish``
    (migration ``outbox_0007``): cutoffs come from the server's clock, the
    record names the login that ran it, and the caller needs no write access
    to history or to the record.

    Purging a delivered message also forgets its idempotency key: the same key
    emitted afterwards is stored (and delivered) again.
    """
    if not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_PURGE_BATCH:
        raise OpsError(f"batch_size must be 1 to {MAX_PURGE_BATCH}, got {batch_size!r}")
    if not isinstance(actor, str) or not actor.strip():
        raise OpsError("an actor is required: it is what outbox_retention_run will say")
    if len(actor) > 255:
        raise OpsError("the actor is longer than 255 characters; give a shorter name")
    if delivered_older_than < timedelta(0):
        raise OpsError("delivered_older_than cannot be negative")
    if history_older_than is not None and history_older_than < MIN_HISTORY_AGE:
        raise OpsError(
            f"history_older_than must be at least {MIN_HISTORY_AGE.days}d: younger history is never purged"
        )
    started = _now()
    # Refused here, before anything is recorded, when a cutoff would fall before year 1.
    _before(started, delivered_older_than, "delivered_older_than")
    if history_older_than is not None:
        _before(started, history_older_than, "history_older_than")
    store: _PurgeStore
    if engine.dialect.name == "postgresql":
        store = _PostgresPurge(engine)
    else:
        store = _EmbeddedPurge(engine)
    run_id = store.start(actor, delivered_older_than, history_older_than, history_of_unresolved)
    messages = attempts = batches = 0
    while True:
        deleted_messages, deleted_attempts = store.step(run_id, batch_size)
        if not deleted_messages and not deleted_attempts:
            break
        messages += deleted_messages
        attempts += deleted_attempts
        batches += 1
        if on_batch is not None:
            on_batch(PurgeResult(messages=messages, attempts=attempts, batches=batches, run_id=run_id))
    store.finish(run_id)
    return PurgeResult(messages=messages, attempts=attempts, batches=batches, run_id=run_id)


class _PurgeStore:
    """One purge's three steps, each its own transaction: start a run, delete a batch, finish."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def start(
        self, actor: str, delivered_age: timedelta, history_age: timedelta | None, unresolved_too: bool
    ) -> int:
        raise NotImplementedError

    def step(self, run_id: int, batch_size: int) -> tuple[int, int]:
        """(messages, history rows) deleted by one batch; (0, 0) when nothing is left."""
        raise NotImplementedError

    def finish(self, run_id: int) -> None:
        raise NotImplementedError


class _PostgresPurge(_PurgeStore):
    """The purge functions of migration outbox_0007: the database writes the record and the counts."""

    def _call(self, statement: str, **params: Any) -> Row[Any]:
        try:
            with self.engine.begin() as conn:
                return conn.execute(text(statement), params).one()
        except DBAPIError as error:
            state = getattr(error.orig, "sqlstate", None)
            if state == "42883":  # undefined_function
                raise OpsError(
                    "this database has no outbox purge functions yet: run `outbox migrate` first"
                ) from None
            if state == "42501" and "function outbox_purge" in str(error.orig):
                raise OpsError(
                    "this role may not run the outbox purge functions: grant it EXECUTE on them"
                    " (docs/operations.md, Least privilege)"
                ) from None
            raise

    def start(
        self, actor: str, delivered_age: timedelta, history_age: timedelta | None, unresolved_too: bool
    ) -> int:
        row = self._call(
            "SELECT outbox_purge_start(:actor, CAST(:delivered AS interval), CAST(:history AS interval),"
            " :unresolved)",
            actor=actor,
            delivered=delivered_age,
            history=history_age,
            unresolved=unresolved_too,
        )
        return int(row[0])

    def step(self, run_id: int, batch_size: int) -> tuple[int, int]:
        row = self._call(
            "SELECT messages_deleted, attempts_deleted FROM outbox_purge_step(:run, :batch)",
            run=run_id,
            batch=batch_size,
        )
        return int(row.messages_deleted), int(row.attempts_deleted)

    def finish(self, run_id: int) -> None:
        self._call("SELECT outbox_purge_finish(:run)", run=run_id)


def _unresolved() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row still waiting on a relay or an operator.

    A dead message counts as resolved once someone requeued it (a copy points
    at it, or its history says so), like the dead figure of :func:`stats`.
    """
    requeued = select(a.c.id).where(a.c.message_id == m.c.id, a.c.outcome == "requeued").exists()
    return or_(
        m.c.status.in_(("pending", "running")),
        and_(m.c.status == "dead", ~_has_copy(), ~requeued),
    )


class _EmbeddedPurge(_PurgeStore):
    """SQLite: the same steps in Python. Whoever holds the database file can do anything to it."""

    def start(
        self, actor: str, delivered_age: timedelta, history_age: timedelta | None, unresolved_too: bool
    ) -> int:
        now = _now()
        with self.engine.begin() as conn:
            run_id: int = conn.execute(
                insert(run)
                .values(
                    started_at=now,
                    actor=actor,
                    delivered_before=now - delivered_age,
                    history_before=None if history_age is None else now - history_age,
                    history_of_unresolved=history_age is not None and unresolved_too,
                )
                .returning(run.c.id)
            ).scalar_one()
        return run_id

    def _open_run(self, conn: Connection, run_id: int) -> Row[Any]:
        found = conn.execute(select(run).where(run.c.id == run_id)).first()
        if found is None or found.finished_at is not None:
            raise OpsError(f"purge run {run_id} is unknown or finished; start a new one")
        return found

    def _add(self, conn: Connection, run_id: int, column: str, deleted: int) -> None:
        conn.execute(update(run).where(run.c.id == run_id).values({column: run.c[column] + deleted}))

    def step(self, run_id: int, batch_size: int) -> tuple[int, int]:
        with self.engine.begin() as conn:
            record = self._open_run(conn, run_id)
            cutoff = literal(record.delivered_before, m.c.updated_at.type)
            ids = list(
                conn.execute(
                    select(m.c.id)
                    .where(m.c.status.in_(("delivered", "discarded")), m.c.updated_at < cutoff)
                    # An original that a requeued copy points at stays while the copy exists.
                    .where(~_has_copy())
                    .order_by(m.c.id)
                    .limit(batch_size)
                ).scalars()
            )
            if ids:
                deleted = conn.execute(delete(m).where(m.c.id.in_(ids))).rowcount
                self._add(conn, run_id, "messages_deleted", deleted)
                return deleted, 0
        if record.history_before is None:
            return 0, 0
        with self.engine.begin() as conn, history_purge_allowed(conn, run_id):
            record = self._open_run(conn, run_id)
            doomed = select(a.c.id).where(
                a.c.started_at < literal(record.history_before, a.c.started_at.type)
            )
            if not record.history_of_unresolved:
                doomed = doomed.where(~select(m.c.id).where(m.c.id == a.c.message_id, _unresolved()).exists())
            ids = list(conn.execute(doomed.order_by(a.c.id).limit(batch_size)).scalars())
            if not ids:
                return 0, 0
            deleted = conn.execute(delete(a).where(a.c.id.in_(ids))).rowcount
            self._add(conn, run_id, "attempts_deleted", deleted)
            return 0, deleted

    def finish(self, run_id: int) -> None:
        with self.engine.begin() as conn:
            self._open_run(conn, run_id)
            conn.execute(update(run).where(run.c.id == run_id).values(finished_at=_now()))
