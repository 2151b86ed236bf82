"""Reading stored messages: ``stats``, ``list_messages``, ``show``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import case, func, literal, select
from sqlalchemy.engine import Engine, Row

from .._redact import Redactor
from .._tables import status_is_one_of
from ._base import (
    NotFound,
    OpsError,
    _copy_id,
    _has_copy,
    _now,
    a,
    as_text,
    decoded,
    m,
)
from ._breakers import Breaker, breakers_on
from ._filters import MessageFilter
from ._pause import Pause, PauseSpan, paused_on, spans_over


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
    # messages a relay claimed past their expires_at and discarded, never handed to a handler
    expired_last_hour: int = 0
    # per queue: pending (due or not, retries included) or running messages, from created_at
    oldest_unfinished_age_s: dict[str, float] = field(default_factory=dict)
    # queues and handlers paused now, oldest first, each with the pending messages it holds back
    paused: list[Pause] = field(default_factory=list)
    # destinations every relay skips (open) or sends one trial to (half-open), oldest first
    breakers: list[Breaker] = field(default_factory=list)
    # per destination: pending messages parked until it recovers (outbox_message.parked_on)
    parked: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "by_status": self.by_status,
            "by_handler_status": self.by_handler_status,
            "oldest_pending_age_s": self.oldest_pending_age_s,
            "oldest_unfinished_age_s": self.oldest_unfinished_age_s,
            "delivered_last_hour": self.delivered_last_hour,
            "failed_last_hour": self.failed_last_hour,
            "expired_last_hour": self.expired_last_hour,
            "dead": self.dead,
            "dead_requeued": self.dead_requeued,
            "paused": [p.as_dict() for p in self.paused],
            "breakers": [b.as_dict() for b in self.breakers],
            "parked": self.parked,
        }


def stats(engine: Engine, *, counts: bool = True) -> Stats:
    """``counts=False`` leaves ``by_status`` and ``by_handler_status`` empty.

    Those two read every row (a million delivered messages take a fifth of a
    second to count); the rest reads indexes only. A caller that counts
    delivered messages its own way, such as the dashboard, which refreshes them
    in the background, skips them.
    """
    now = _now()
    hour_ago = now - timedelta(hours=1)
    with engine.connect() as conn:
        by_handler: dict[str, dict[str, int]] = {}
        by_status: dict[str, int] = {}
        rows = (
            conn.execute(select(m.c.handler, m.c.status, func.count()).group_by(m.c.handler, m.c.status))
            if counts
            else ()
        )
        for handler, status, count in rows:
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
                .where(status_is_one_of("pending", "running"))
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
        paused = paused_on(conn)
        open_breakers = breakers_on(conn)
        parked: dict[str, int] = dict(
            conn.execute(  # the partial index of parked messages: no other row is read
                select(m.c.parked_on, func.count())
                .where(m.c.parked_on.is_not(None), m.c.status == "pending")
                .group_by(m.c.parked_on)
            ).all()
        )
    failed = sum(outcomes.get(o, 0) for o in ("retry", "failed", "timeout", "dead", "lease_expired"))
    return Stats(
        by_status=by_status,
        by_handler_status=by_handler,
        oldest_pending_age_s=oldest,
        delivered_last_hour=outcomes.get("delivered", 0),
        failed_last_hour=failed,
        expired_last_hour=outcomes.get("expired", 0),
        dead=dead_total - dead_requeued,
        dead_requeued=dead_requeued,
        oldest_unfinished_age_s=unfinished,
        paused=paused,
        breakers=open_breakers,
        parked=parked,
    )


def list_messages(
    engine: Engine, where: MessageFilter | None = None, *, limit: int = 50, before_id: int | None = None
) -> list[Row[Any]]:
    """Newest first. Page with ``before_id`` = the last id of the previous page (stable under inserts).

    Each row carries ``requeued_to``, the id of the copy a requeue made of it
    (None when there is none): a requeued original stays ``dead``, and this is
    what tells a reader it has been dealt with.
    """
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
            _copy_id().label("requeued_to"),
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
    #: pauses of its queue or handler while it was unfinished (from outbox_pause_log)
    pauses: list[PauseSpan] = field(default_factory=list)


def show(engine: Engine, message_id: int, *, secrets: Iterable[str] = ()) -> MessageHistory:
    """A message (payload and headers with secret-looking fields masked), its attempts in order, its pauses.

    The message holds every column and ``requeued_to``, the id of the copy a
    requeue made of it (None when there is none).

    ``pauses`` are the pauses of the message's queue or handler that overlapped
    its unfinished life (from ``created_at`` to its last update once delivered,
    dead or discarded; to now otherwise), read from the pause log: nothing is
    written per message when a queue is paused.
    """
    redactor = Redactor(secrets)
    with engine.connect() as conn:
        columns = [*as_text(m, "payload", "headers"), _copy_id().label("requeued_to")]
        row = conn.execute(select(*columns).where(m.c.id == message_id)).first()
        if row is None:
            raise NotFound(f"no message with id {message_id}")
        attempts = list(
            conn.execute(select(*as_text(a, "detail")).where(a.c.message_id == message_id).order_by(a.c.id))
        )
        finished = row.status in ("delivered", "dead", "discarded")
        pauses = spans_over(
            conn,
            [("queue", row.queue), ("handler", row.handler)],
            row.created_at,
            row.updated_at if finished else None,
        )
    message = dict(row._mapping)
    message["payload"] = redactor.value(decoded(message["payload"]))
    message["headers"] = redactor.value(decoded(message["headers"]))
    history = [{**r._mapping, "detail": redactor.value(decoded(r.detail))} for r in attempts]
    return MessageHistory(message=message, attempts=history, pauses=pauses)


def login_apart(detail: Any) -> tuple[Any, str | None]:
    """A history row's detail without ``db_user``, and that login: the table shows it beside the label.

    PostgreSQL stamps every row with the login that wrote it (``db_user``); it
    belongs with the relay id or actor it vouches for, not among the handler's facts.
    """
    if not isinstance(detail, dict) or not isinstance(detail.get("db_user"), str):
        return detail, None
    rest = {k: v for k, v in detail.items() if k != "db_user"}
    return rest, detail["db_user"]
