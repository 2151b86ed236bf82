"""``resend``: deliver a finished message again, as a new copy, when its receiver lost it."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.engine import Engine

from ._base import ACTION_BATCH, RESENDABLE, _check_batch_size, _check_reason, _now, m
from ._copies import COPY_COLUMNS, RESEND, copy_rows
from ._filters import MessageFilter, _filtered_batches, _named

__all__ = ["resend"]

#: Why a status is refused, said after the refusal.
_HINTS = {
    "dead": "a dead message is requeued, not resent",
    "pending": "a pending or running message is still on its way",
    "running": "a pending or running message is still on its way",
}


def resend(
    engine: Engine, where: MessageFilter, *, reason: str, actor: str, batch_size: int = ACTION_BATCH
) -> list[tuple[int, int]]:
    """Deliver delivered (or discarded) messages again, each as a new copy; returns (old id, new id) pairs.

    For a receiver that lost what it acknowledged ("the partner lost order 42's
    webhook"). The copy is a new ``pending`` message with the original's event
    id, payload, route, group and aggregate, so a receiver that deduplicates by
    event id still can; ``requeued_from`` names the original, as a requeued
    copy's does. Its idempotency key gains a ``~resend:<new id>`` suffix (see
    :func:`~outbox.ops.resent_key`); its :func:`~outbox.ops.root_key` is the
    original's. The original is not touched: a ``resent`` history row on it
    names the actor, the reason and the new id.

    Unlike requeue, a message may be resent any number of times: each resend
    is a deliberate new delivery, and each copy's key names the copy, so the
    copies never collide. Pending and running messages are still on their
    way, and dead ones are requeue's: named ids in any of those statuses are
    refused, all of them with the reason.

    Named ids are acted on in one transaction, all or none. A filter works in
    batches of ``batch_size`` messages, each its own transaction; it never
    reads, locks or changes a message in any other status than delivered or
    discarded, and takes only messages that existed when it began, so a copy
    it made that a relay delivers meanwhile is not resent in turn.
    """
    _check_reason(reason, actor)
    _check_batch_size(batch_size)
    now = _now()
    if where.ids:
        with engine.begin() as conn:
            targets = _named(conn, where, RESENDABLE, "resend", COPY_COLUMNS, _HINTS)
            return copy_rows(conn, targets, RESEND, actor, reason, now, strict=True)
    with engine.connect() as conn:
        newest = conn.execute(select(func.max(m.c.id))).scalar_one_or_none() or 0
    pairs: list[tuple[int, int]] = []
    existing = m.c.id <= newest
    batches = _filtered_batches(engine, where, RESENDABLE, "resend", COPY_COLUMNS, batch_size, existing)
    for conn, batch in batches:
        pairs += copy_rows(conn, batch, RESEND, actor, reason, now, strict=False)
    return pairs
