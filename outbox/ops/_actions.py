"""An operator's actions on messages: requeue, discard, retry-now, each recorded in history."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, literal, select, update
from sqlalchemy.engine import Connection, Engine, Row

from ._base import (
    ACTION_BATCH,
    DISCARDABLE,
    KEY_LIMIT,
    MAX_ID,
    REQUEUABLE,
    NotFound,
    OpsError,
    _check_batch_size,
    _check_reason,
    _has_copy,
    _now,
    a,
    m,
)
from ._filters import MessageFilter, _all_or_none, _filtered_batches, _named, _tried, _waiting
from ._in_database import call

_REQUEUE_MARK = "~requeue:"
_REQUEUE_SUFFIXES = re.compile(r"(?:~requeue:[0-9]+)+$")
#: The longest key a requeued copy repeats whole: room is kept for ``~requeue:`` and the
#: 19 digits of the largest id (BIGINT), so whatever id is copied, the suffix fits after it.
ROOT_KEY_LIMIT = KEY_LIMIT - len(_REQUEUE_MARK) - len(str(MAX_ID))
_DIGEST_MARK = "~sha256:"
_DIGEST_LENGTH = 32


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


def root_key(key: str) -> str:
    """What the key of a message and the keys of all its requeued copies have in common.

    ``key`` without its ``~requeue:<id>`` suffixes: the original message's key.
    One longer than :data:`ROOT_KEY_LIMIT` (227) characters, which a copy
    could not repeat whole next to a suffix for a 19-digit id, stands for
    itself shortened to exactly that length: its first 187 characters,
    ``~sha256:`` and 32 hex digits of the SHA-256 of the whole. Applied to a
    copy's key it gives the same string as applied to the original's, so a
    handler that derives a side effect's identity from it (the email
    handler's ``Message-ID``) treats every copy as the same delivery.
    """
    stem = _REQUEUE_SUFFIXES.sub("", key)
    if len(stem) <= ROOT_KEY_LIMIT:
        return stem
    digest = hashlib.sha256(stem.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_LENGTH]
    return f"{stem[: ROOT_KEY_LIMIT - len(_DIGEST_MARK) - _DIGEST_LENGTH]}{_DIGEST_MARK}{digest}"


def requeued_key(key: str | None, old_id: int) -> str | None:
    """The idempotency key of the requeued copy of message ``old_id`` whose key is ``key``.

    ``<key>~requeue:<old id>``; when that would not fit the column, the suffix
    follows :func:`root_key` of ``key`` instead (the original's key, or its
    stand-in, without the earlier copies' suffixes). A key is never simply cut
    short: its :func:`root_key`, which handlers may derive identities from, is
    the original's at any length.
    The suffix names the message copied, and a message is copied at most once,
    so the copy's key is unique for its route (it never equals the
    original's), and a copy of a copy gets its own suffix in turn.
    """
    if key is None:
        return None
    suffix = f"{_REQUEUE_MARK}{old_id}"
    if len(key) + len(suffix) <= KEY_LIMIT:
        return key + suffix
    return root_key(key) + suffix


def _copy(conn: Connection, old: Row[Any], actor: str, reason: str, now: datetime) -> int:
    """SQLite: copy ``old`` as a new pending message, its documents copied inside the database.

    Copied by ``INSERT ... SELECT``, never read into Python: a payload stored before
    emit capped nesting may be too deep for Python's JSON decoder, and is still requeued.
    """
    kept = ["event_id", "event_type", "handler", "queue", "priority", "payload", "headers"]
    kept += ["aggregate_type", "aggregate_id", "group_key", "max_attempts"]
    fresh = {
        "idempotency_key": literal(requeued_key(old.idempotency_key, old.id), m.c.idempotency_key.type),
        "status": literal("pending"),
        "attempts": literal(0),
        "available_at": literal(now, m.c.available_at.type),
        "created_at": literal(now, m.c.created_at.type),
        "updated_at": literal(now, m.c.updated_at.type),
        "requeued_from": m.c.id,
    }
    source = select(*(m.c[name] for name in kept), *fresh.values()).where(m.c.id == old.id)
    new_id: int = conn.execute(insert(m).from_select([*kept, *fresh], source).returning(m.c.id)).scalar_one()
    _record_action(conn, old, "requeued", actor, reason, now, new_id=new_id)
    return new_id


#: What requeue reads of a message: never its documents (the copy is made inside the database).
_REQUEUE_COLUMNS = [m.c.id, m.c.status, m.c.attempts, m.c.idempotency_key]


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
            targets = _named(conn, where, REQUEUABLE, "requeue", _REQUEUE_COLUMNS)
            copied = _requeued_as(conn, [r.id for r in targets])
            if copied:
                listed = ", ".join(f"{old} (as {new})" for old, new in sorted(copied.items()))
                raise OpsError(f"already requeued: {listed}; if a copy failed too, requeue the copy")
            return _requeue_rows(conn, targets, actor, reason, now, strict=True)
    batches = _filtered_batches(
        engine, where, REQUEUABLE, "requeue", _REQUEUE_COLUMNS, batch_size, ~_has_copy()
    )
    for conn, batch in batches:
        # Read again just before acting: a concurrent requeue may have committed a copy since the
        # query began (the database function checks once more under its lock).
        copied = _requeued_as(conn, [r.id for r in batch])
        fresh = [old for old in batch if old.id not in copied]
        pairs += _requeue_rows(conn, fresh, actor, reason, now, strict=False)
    return pairs


def _requeue_rows(
    conn: Connection, rows: Sequence[Row[Any]], actor: str, reason: str, now: datetime, *, strict: bool
) -> list[tuple[int, int]]:
    """Copy each of ``rows``; ``strict``: all of them or none (the database re-checks each under a lock)."""
    if conn.dialect.name != "postgresql":
        return [(old.id, _copy(conn, old, actor, reason, now)) for old in rows]
    found = call(
        conn,
        "SELECT old_id, new_id FROM outbox_requeue(:ids, :keys, :actor, :reason, :strict)",
        ids=[r.id for r in rows],
        keys=[requeued_key(r.idempotency_key, r.id) for r in rows],
        actor=actor,
        reason=reason,
        strict=strict,
    )
    return [(r.old_id, r.new_id) for r in found]


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
    """Make those of ``rows`` still waiting due at ``now``, each with a history row; returns their ids."""
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
        return sorted(r[0] for r in found)
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
