"""An operator's actions on messages: requeue, discard, retry-now, each recorded in history."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, literal, select, update
from sqlalchemy.engine import Connection, Engine, Row

from ._base import (
    ACTION_BATCH,
    DISCARDABLE,
    REQUEUABLE,
    NotFound,
    OpsError,
    _check_batch_size,
    _check_reason,
    _has_copy,
    _now,
    _record_action,
    m,
)
from ._breakers import clear_for_retry
from ._copies import COPY_COLUMNS, REQUEUE, copy_rows
from ._filters import MessageFilter, _all_or_none, _filtered_batches, _named, _tried, _waiting
from ._in_database import call
from ._keys import ROOT_KEY_LIMIT, requeued_key, root_key

__all__ = ["ROOT_KEY_LIMIT", "discard", "requeue", "requeued_key", "retry_now", "root_key"]


def _copied_as(conn: Connection, ids: Sequence[int]) -> dict[int, int]:
    """Old id → id of its newest copy, for those of ``ids`` that were requeued or resent before."""
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


def requeue(
    engine: Engine, where: MessageFilter, *, reason: str, actor: str, batch_size: int = ACTION_BATCH
) -> list[tuple[int, int]]:
    """Give dead (or discarded) messages a fresh start as new messages; returns (old id, new id) pairs.

    The old row is not touched: a ``requeued`` history row on it names the
    actor, the reason and the new id. The copy keeps the event id, payload,
    route, group and aggregate; its idempotency key gains a ``~requeue:<old id>``
    suffix (see :func:`requeued_key`), because (route, key) is unique and the
    old row still holds the key; its :func:`root_key` is the original's.

    A message is requeued at most once, because the old row stays dead and a
    second copy would deliver the event twice: named ids that already have a
    copy (requeued, or for a discarded one, resent) are refused (requeue the
    copy if it failed too), a filter skips them.

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
            targets = _named(conn, where, REQUEUABLE, "requeue", COPY_COLUMNS)
            copied = _copied_as(conn, [r.id for r in targets])
            if copied:
                listed = ", ".join(f"{old} (as {new})" for old, new in sorted(copied.items()))
                raise OpsError(
                    f"already requeued or resent: {listed}; if a copy failed too, requeue the copy"
                )
            return copy_rows(conn, targets, REQUEUE, actor, reason, now, strict=True)
    batches = _filtered_batches(engine, where, REQUEUABLE, "requeue", COPY_COLUMNS, batch_size, ~_has_copy())
    for conn, batch in batches:
        # Read again just before acting: a concurrent requeue may have committed a copy since the
        # query began (the database function checks once more under its lock).
        copied = _copied_as(conn, [r.id for r in batch])
        fresh = [old for old in batch if old.id not in copied]
        pairs += copy_rows(conn, fresh, REQUEUE, actor, reason, now, strict=False)
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
            named = _named(conn, where, DISCARDABLE, "discard", columns)
            return _discard_rows(conn, named, actor, reason, now, strict=True)
    done: list[int] = []
    for conn, batch in _filtered_batches(engine, where, DISCARDABLE, "discard", columns, batch_size):
        done += _discard_rows(conn, batch, actor, reason, now, strict=False)
    return done


def _discard_rows(
    conn: Connection, rows: Sequence[Row[Any]], actor: str, reason: str, now: datetime, *, strict: bool
) -> list[int]:
    if conn.dialect.name != "postgresql":
        return [r.id for r in rows if _discard_one(conn, r, actor, reason, now)]
    found = call(
        conn,
        "SELECT outbox_discard(:ids, :actor, :reason, :strict)",
        ids=[r.id for r in rows],
        actor=actor,
        reason=reason,
        strict=strict,
    )
    return [r[0] for r in found]


def _make_due(
    conn: Connection,
    rows: Sequence[Row[Any]],
    actor: str,
    reason: str,
    now: datetime,
    *,
    include_delayed: bool,
    strict: bool,
) -> list[int]:
    """Make those of ``rows`` still waiting due at ``now``, each with a history row; returns their ids.

    The circuit breakers that would turn them away again are cleared in the
    same transaction (``clear_for_retry``).
    """
    if not rows:
        return []
    if conn.dialect.name == "postgresql":
        found = call(
            conn,
            "SELECT outbox_retry_now(:ids, :actor, :reason, :include_delayed, :strict)",
            ids=[r.id for r in rows],
            actor=actor,
            reason=reason,
            include_delayed=include_delayed,
            strict=strict,
        )
        done = sorted(r[0] for r in found)
        clear_for_retry(conn, rows, done, actor=actor, reason=reason)
        return done
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
    clear_for_retry(conn, rows, sorted(due), actor=actor, reason=reason)
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
    are woken at once (NOTIFY on the channel they listen on). The circuit
    breakers that turned one of them away, or that their routes opened, are
    reset for every relay (logged as ``retried_now`` with the same actor and
    reason): a relay would defer them again at once otherwise.

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
    columns = [m.c.id, m.c.handler, m.c.status, m.c.attempts, m.c.available_at]
    waiting = _waiting(now, include_delayed)
    if where.ids:
        with engine.begin() as conn:
            targets = _named_waiting(conn, where, now, include_delayed, columns)
            done = _make_due(conn, targets, actor, reason, now, include_delayed=include_delayed, strict=True)
            if len(done) != len(targets):  # SQLite takes no row locks: a relay may have claimed one since
                changed = sorted({r.id for r in targets} - set(done))
                raise OpsError(f"message {', '.join(map(str, changed))} changed meanwhile; try again")
            return done
    acted: list[int] = []
    batches = _filtered_batches(engine, where, ("pending",), "retry-now", columns, batch_size, *waiting)
    for conn, batch in batches:
        acted += _make_due(conn, batch, actor, reason, now, include_delayed=include_delayed, strict=False)
    return acted


def _named_waiting(
    conn: Connection, where: MessageFilter, now: datetime, include_delayed: bool, columns: Sequence[Any]
) -> list[Row[Any]]:
    """The rows of named ids; each must be waiting (see :func:`retry_now`), or none is acted on.

    As in :func:`_named`, nothing is locked here: what acts on the rows locks and checks them again.
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
    stmt = where.apply(select(*columns)).where(*_waiting(now, include_delayed))
    return _all_or_none(conn, stmt, found, "changed meanwhile")
