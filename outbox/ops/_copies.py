"""Copying a message as a new pending one: what requeue and resend share.

A copy keeps the event id, payload, headers, route, priority, group,
aggregate and ``max_attempts``; it starts ``pending`` with no attempts, points
back at the message copied (``requeued_from``) and has a key of its own (see
``_keys``). The message copied is never changed: a history row on it names
the actor, the reason and the copy (``detail.new_id``). On PostgreSQL the
database makes the copy and writes that row (``outbox_requeue``,
``outbox_resend``); SQLite, which has no roles, does both from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert, literal, select, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from ._base import REQUEUABLE, RESENDABLE, OpsError, _record_action, m
from ._in_database import call
from ._keys import requeued_key, resent_key, root_key

__all__ = ["COPY_COLUMNS", "REQUEUE", "RESEND", "Copying", "copy_rows"]


@dataclass(frozen=True, slots=True)
class Copying:
    """One way of copying: the verb, the history outcome it writes, the statuses it copies."""

    verb: str
    outcome: str
    allowed: tuple[str, ...]


REQUEUE = Copying("requeue", "requeued", REQUEUABLE)
RESEND = Copying("resend", "resent", RESENDABLE)

#: What copying reads of a message: never its documents (the copy is made inside the database).
COPY_COLUMNS = [m.c.id, m.c.status, m.c.attempts, m.c.idempotency_key]

_KEPT = [
    "event_id",
    "event_type",
    "handler",
    "queue",
    "priority",
    "payload",
    "headers",
    "aggregate_type",
    "aggregate_id",
    "group_key",
    "max_attempts",
]


def copy_rows(
    conn: Connection,
    rows: Sequence[Row[Any]],
    how: Copying,
    actor: str,
    reason: str,
    now: datetime,
    *,
    strict: bool,
) -> list[tuple[int, int]]:
    """Copy each of ``rows`` (read with :data:`COPY_COLUMNS`); returns (old id, new id) pairs.

    ``strict``: all of them or none; otherwise one that is no longer in a
    status ``how`` copies is skipped (the database checks again under a lock).
    """
    if conn.dialect.name != "postgresql":
        pairs: list[tuple[int, int]] = []
        for old in rows:
            new_id = _copy(conn, old, how, actor, reason, now)
            if new_id is not None:
                pairs.append((old.id, new_id))
            elif strict:
                raise OpsError(f"message {old.id} changed status meanwhile; try again")
        return pairs
    found = call(
        conn,
        f"SELECT old_id, new_id FROM outbox_{how.verb}(:ids, :keys, :actor, :reason, :strict)",
        ids=[r.id for r in rows],
        keys=[_key_given(how, r) for r in rows],
        actor=actor,
        reason=reason,
        strict=strict,
    )
    return [(r.old_id, r.new_id) for r in found]


def _key_given(how: Copying, old: Row[Any]) -> str | None:
    """What the database function is given for ``old``'s copy: requeue's whole key, resend's stem.

    Resend's suffix names the copy, whose id only the database knows; it gets
    the :func:`root_key` to put before it when the original's key and the
    suffix would not fit the column together.
    """
    if how is REQUEUE:
        return requeued_key(old.idempotency_key, old.id)
    return None if old.idempotency_key is None else root_key(old.idempotency_key)


def _copy(
    conn: Connection, old: Row[Any], how: Copying, actor: str, reason: str, now: datetime
) -> int | None:
    """SQLite: copy ``old`` if it is still in a status ``how`` copies; the new id, else None.

    Copied by ``INSERT ... SELECT``, never read into Python: a payload stored
    before emit capped nesting may be too deep for Python's JSON decoder, and
    is still copied. A resent copy gets its key once its id is known.
    """
    key = requeued_key(old.idempotency_key, old.id) if how is REQUEUE else None
    fresh = {
        "idempotency_key": literal(key, m.c.idempotency_key.type),
        "status": literal("pending"),
        "attempts": literal(0),
        "available_at": literal(now, m.c.available_at.type),
        "created_at": literal(now, m.c.created_at.type),
        "updated_at": literal(now, m.c.updated_at.type),
        "requeued_from": m.c.id,
    }
    source = select(*(m.c[name] for name in _KEPT), *fresh.values()).where(
        m.c.id == old.id, m.c.status.in_(how.allowed)
    )
    copied = insert(m).from_select([*_KEPT, *fresh], source).returning(m.c.id)
    new_id: int | None = conn.execute(copied).scalar_one_or_none()
    if new_id is None:
        return None
    if how is RESEND and old.idempotency_key is not None:
        conn.execute(
            update(m).where(m.c.id == new_id).values(idempotency_key=resent_key(old.idempotency_key, new_id))
        )
    try:
        _record_action(conn, old, how.outcome, actor, reason, now, new_id=new_id)
    except IntegrityError as error:
        if "ck_outbox_attempt_outcome" not in str(error):
            raise
        raise OpsError(
            f"this database has no {how.outcome!r} history outcome yet: run `outbox migrate` first"
        ) from None
    return new_id
