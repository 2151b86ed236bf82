"""Requeueing the inbox's dead letters: an operator's decision, recorded on the dead letter itself.

A requeue moves a dead letter from ``dead`` to ``requeued`` and records when
(``requeued_at``), the actor's label, the reason and, on PostgreSQL, the login
(``db_user``). Its consumer takes it up at its next
``Inbox.process_requeued``: ``handled`` when its handlers succeed, ``dead``
again (with the new error) when they fail. Nothing else about the dead letter
changes, and its marker keeps saying ``dead``, so the broker's redeliveries
stay duplicates.

On PostgreSQL the ``SECURITY DEFINER`` function ``outbox_inbox_requeue``
(migration ``outbox_0022``) locks the dead letters in id order, checks their
status again under the lock, writes them, and notifies the consumers (``NOTIFY
outbox_inbox``): the operator's login needs EXECUTE on it, and no UPDATE on the
table. SQLite has no roles: the same UPDATE runs from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from .._tables import outbox_inbox_dead
from ._base import ACTION_BATCH, InvalidRequest, NotFound, OpsError, _check_batch_size, _check_reason, _now
from ._inbox import InboxDeadLetter, check_dead_letter_id, inbox_dead_letter

__all__ = ["requeue_inbox_dead_letter", "requeue_inbox_dead_letters"]

d = outbox_inbox_dead
#: SQLSTATEs ``outbox_inbox_requeue`` raises for a refused request: its message says what to do.
_REFUSED = {"55000", "22023", "P0002"}


def _check_consumer(consumer: Any) -> str:
    if not isinstance(consumer, str) or not consumer.strip() or len(consumer) > 255:
        raise InvalidRequest(f"name the consumer (an inbox's name, 1 to 255 characters), got {consumer!r}")
    return consumer


def _in_database(conn: Connection, ids: Sequence[int], actor: str, reason: str, *, strict: bool) -> list[int]:
    """``outbox_inbox_requeue`` in the caller's transaction; a refusal becomes an :class:`OpsError`."""
    statement = text("SELECT outbox_inbox_requeue(:ids, :actor, :reason, :strict)")
    params = {"ids": list(ids), "actor": actor, "reason": reason, "strict": strict}
    try:
        return sorted(int(i) for i in conn.execute(statement, params).scalars())
    except DBAPIError as error:
        state = getattr(error.orig, "sqlstate", None)
        said = str(error.orig)
        if state == "42883" and "outbox_inbox_requeue" in said:
            raise OpsError(
                "this database cannot requeue inbox dead letters yet: run `outbox migrate` first"
            ) from None
        if state == "42501" and "function outbox_inbox_requeue" in said:
            raise OpsError(
                "this role may not requeue inbox dead letters: grant it EXECUTE on outbox_inbox_requeue"
                " (docs/operations.md, Least privilege)"
            ) from None
        if state in _REFUSED:
            raise OpsError(said.splitlines()[0]) from None
        raise


def _requeue(conn: Connection, ids: Sequence[int], actor: str, reason: str, *, strict: bool) -> list[int]:
    """Requeue those of ``ids`` that are dead now; ``strict``: all of them, or refuse."""
    if not ids:
        return []
    if conn.dialect.name == "postgresql":
        return _in_database(conn, ids, actor, reason, strict=strict)
    done = sorted(
        conn.execute(
            update(d)
            .where(d.c.id.in_(list(ids)), d.c.status == "dead")
            .values(status="requeued", requeued_at=_now(), actor=actor, reason=reason, handled_at=None)
            .returning(d.c.id)
        ).scalars()
    )
    if strict and len(done) != len(set(ids)):
        changed = ", ".join(str(i) for i in sorted(set(ids) - set(done)))
        raise OpsError(f"inbox dead letter {changed} changed meanwhile; try again")
    return done


def _named(conn: Connection, ids: Sequence[int]) -> None:
    """Refuse, naming each, ids of no dead letter or of one not ``dead`` (nothing is locked here)."""
    found = dict(conn.execute(select(d.c.id, d.c.status).where(d.c.id.in_(list(ids)))).all())
    missing = [i for i in ids if i not in found]
    if missing:
        raise NotFound(f"no inbox dead letter with id {', '.join(map(str, missing))}")
    wrong = [f"{i} ({found[i]})" for i in ids if found[i] != "dead"]
    if wrong:
        raise OpsError(
            f"only dead letters whose status is dead can be requeued; not {', '.join(wrong)}"
            " (a requeued one waits for its consumer's process_requeued; a handled one is done)"
        )


def requeue_inbox_dead_letters(
    engine: Engine,
    ids: Iterable[int] = (),
    *,
    consumer: str | None = None,
    reason: str,
    actor: str,
    batch_size: int = ACTION_BATCH,
) -> list[int]:
    """Requeue dead letters by id, or every dead one of a consumer; returns the ids requeued, in order.

    Named ids are acted on in one transaction, all or none: each must exist
    and be ``dead`` (:class:`NotFound`, else :class:`OpsError` naming the
    others' statuses). ``consumer`` requeues every dead letter of that inbox
    that is ``dead`` now, in batches of ``batch_size``, each its own
    transaction; none is no error (an empty list). Give one or the other.
    """
    _check_reason(reason, actor)
    _check_batch_size(batch_size)
    wanted = sorted({check_dead_letter_id(i) for i in ids})
    if bool(wanted) == (consumer is not None):
        raise InvalidRequest(
            "give dead letter ids or a consumer (not both): a requeue never acts on everything"
        )
    if wanted:
        with engine.begin() as conn:
            _named(conn, wanted)
            return _requeue(conn, wanted, actor, reason, strict=True)
    name = _check_consumer(consumer)
    done: list[int] = []
    last = 0
    while True:
        with engine.begin() as conn:
            batch = list(
                conn.execute(
                    select(d.c.id)
                    .where(d.c.consumer == name, d.c.status == "dead", d.c.id > last)
                    .order_by(d.c.id)
                    .limit(batch_size)
                ).scalars()
            )
            done += _requeue(conn, batch, actor, reason, strict=False)
        if len(batch) < batch_size:
            return done
        last = batch[-1]


def requeue_inbox_dead_letter(engine: Engine, dead_id: int, *, actor: str, reason: str) -> InboxDeadLetter:
    """Requeue one dead letter; returns it as it is now (``requeued``), payload secrets masked.

    Its consumer's next ``Inbox.process_requeued`` runs its handlers once
    more. Raises :class:`NotFound` for an unknown id and :class:`OpsError`
    when its status is not ``dead`` (requeued already, or handled).
    """
    requeue_inbox_dead_letters(engine, [dead_id], reason=reason, actor=actor)
    return inbox_dead_letter(engine, dead_id)
