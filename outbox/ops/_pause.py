"""Pausing a queue or a handler: relays stop claiming its messages until someone resumes it.

``outbox_pause`` holds what is paused now (one row per queue or handler) and
every relay's claim reads it, so a pause takes effect at the next claim of
every relay, serving or draining, without a restart. Messages held back are
not touched: they stay pending with their ``available_at``, attempts and
order, and deliveries already running finish normally. A resume deletes the
row and, on PostgreSQL, wakes the relays (NOTIFY), so what was held back is
claimed at once.

Every pause and resume is appended to ``outbox_pause_log`` (actor, reason,
time) in the same transaction as the change it records. A message's view of
its pauses (``outbox show``) is read from that log, pairing each pause of its
queue or handler with the resume that ended it: a queue of a million messages
held back costs two log rows, not a million history rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, exists, func, insert, or_, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from .._exceptions import ConfigurationError
from .._routes import check_name
from .._tables import outbox_pause, outbox_pause_log
from ._base import InvalidRequest, OpsError, _check_reason, _now, m
from ._in_database import call

__all__ = ["NotPaused", "Pause", "PauseResult", "PauseSpan", "pause", "paused", "resume"]

p = outbox_pause
log = outbox_pause_log


class NotPaused(OpsError):
    """A resume named a queue or handler that is not paused."""


@dataclass(frozen=True, slots=True)
class Pause:
    """A queue or handler paused now. ``held_back``: its pending messages (due or not) when read."""

    kind: str  # "queue" or "handler"
    name: str
    reason: str
    actor: str
    paused_at: datetime
    held_back: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "reason": self.reason,
            "actor": self.actor,
            "paused_at": self.paused_at,
            "held_back": self.held_back,
        }


@dataclass(frozen=True, slots=True)
class PauseResult:
    """What :func:`pause` did.

    ``changed`` is False when it was paused already (nothing was written; ``pause``
    is the pause in force). ``known`` is False when no message has ever used that
    queue or handler: the pause holds anyway (a queue named only at emit time, a
    route not deployed yet), but the name may be a typo.
    """

    pause: Pause
    changed: bool
    known: bool


@dataclass(frozen=True, slots=True)
class PauseSpan:
    """One pause of a message's queue or handler, from the log; ``resumed_at`` None: still paused."""

    kind: str
    name: str
    paused_at: datetime
    paused_by: str
    pause_reason: str
    resumed_at: datetime | None = None
    resumed_by: str | None = None
    resume_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "paused_at": self.paused_at,
            "paused_by": self.paused_by,
            "pause_reason": self.pause_reason,
            "resumed_at": self.resumed_at,
            "resumed_by": self.resumed_by,
            "resume_reason": self.resume_reason,
        }


def _target(queue: str | None, handler: str | None) -> tuple[str, str]:
    if (queue is None) == (handler is None):
        raise InvalidRequest("name exactly one queue or one handler")
    kind, name = ("queue", queue) if queue is not None else ("handler", handler)
    try:
        return kind, check_name(kind, name)
    except ConfigurationError as error:
        raise InvalidRequest(str(error)) from None


def _column(kind: str) -> Any:
    return m.c.queue if kind == "queue" else m.c.handler


def _held_back(conn: Connection, kind: str, name: str) -> int:
    """Pending messages of the queue (claim index) or handler (status/handler index)."""
    stmt = select(func.count()).where(m.c.status == "pending", _column(kind) == name)
    return int(conn.execute(stmt).scalar_one())


def _known(conn: Connection, kind: str, name: str) -> bool:
    column = _column(kind)
    if (
        kind == "queue"
        and conn.execute(select(exists().where(m.c.status == "pending", column == name))).scalar()
    ):
        return True  # the claim index answers the common case; only an unknown name reads further
    return bool(conn.execute(select(exists().where(column == name))).scalar())


def _in_force(conn: Connection, kind: str, name: str) -> Pause | None:
    row = conn.execute(select(p).where(p.c.kind == kind, p.c.name == name)).first()
    if row is None:
        return None
    return Pause(row.kind, row.name, row.reason, row.actor, row.paused_at)


def _logged(
    conn: Connection, event: str, kind: str, name: str, actor: str, reason: str, at: datetime
) -> None:
    conn.execute(insert(log).values(event=event, kind=kind, name=name, at=at, actor=actor, reason=reason))


def pause(
    engine: Engine, *, queue: str | None = None, handler: str | None = None, reason: str, actor: str
) -> PauseResult:
    """Stop every relay claiming messages of ``queue`` (or of the route ``handler``) until :func:`resume`.

    Effective at each relay's next claim (no restart). Deliveries already
    running finish; the held messages stay pending, untouched. Pausing what is
    paused already changes nothing and writes nothing (``changed`` False).
    The pause and its log row (actor, reason) are one transaction.
    """
    kind, name = _target(queue, handler)
    _check_reason(reason, actor)
    for _ in range(2):  # a concurrent pause of the same name may win the insert: read it then
        try:
            with engine.begin() as conn:
                current = _in_force(conn, kind, name)
                if current is not None:
                    held = _held_back(conn, kind, name)
                    return PauseResult(_with_held(current, held), changed=False, known=True)
                if conn.dialect.name == "postgresql":
                    (row,) = call(
                        conn,
                        "SELECT * FROM outbox_pause(:kind, :name, :actor, :reason)",
                        kind=kind,
                        name=name,
                        actor=actor,
                        reason=reason,
                    )
                    now, changed = row.paused_at, row.changed
                    reason, actor = row.paused_reason, row.paused_actor
                else:
                    now, changed = _now(), True
                    conn.execute(
                        insert(p).values(kind=kind, name=name, reason=reason, actor=actor, paused_at=now)
                    )
                    _logged(conn, "paused", kind, name, actor, reason, now)
                known = _known(conn, kind, name) if changed else True  # paused meanwhile: it is known
                made = Pause(kind, name, reason, actor, now, _held_back(conn, kind, name))
                return PauseResult(made, changed=changed, known=known)
        except IntegrityError:
            continue
    raise OpsError(f"{kind} {name!r} was paused and resumed meanwhile; try again")


def resume(
    engine: Engine, *, queue: str | None = None, handler: str | None = None, reason: str, actor: str
) -> Pause:
    """End the pause of ``queue`` (or ``handler``); returns the pause it ended, with what it held back.

    On PostgreSQL the relays are woken at once (NOTIFY): what was held back
    and is due is claimed without waiting for a poll interval. Raises
    :class:`NotPaused` when it is not paused: a mistyped name must not look
    like a resume.
    """
    kind, name = _target(queue, handler)
    _check_reason(reason, actor)
    with engine.begin() as conn:
        ended = _ended(conn, kind, name, actor, reason)
        if ended is None:
            others = ", ".join(
                f"{r.kind} {r.name}" for r in conn.execute(select(p).order_by(p.c.kind, p.c.name))
            )
            raise NotPaused(
                f"{kind} {name!r} is not paused; nothing to resume"
                + (f" (paused now: {others})" if others else " (nothing is paused)")
            )
        held = _held_back(conn, kind, name)
    return Pause(kind, name, *ended, held)


def _ended(
    conn: Connection, kind: str, name: str, actor: str, reason: str
) -> tuple[str, str, datetime] | None:
    """The pause a resume ends (its reason, actor and start), its log row written; None if not paused.

    On PostgreSQL the database function also wakes the relays (NOTIFY), so what
    was held back is claimed now, not at their next poll.
    """
    if conn.dialect.name == "postgresql":
        if _in_force(conn, kind, name) is None:
            return None
        (row,) = call(
            conn,
            "SELECT paused_reason AS reason, paused_actor AS actor, paused_at"
            " FROM outbox_resume(:kind, :name, :actor, :reason)",
            kind=kind,
            name=name,
            actor=actor,
            reason=reason,
        )
        return row.reason, row.actor, row.paused_at
    ended = conn.execute(
        p.delete().where(p.c.kind == kind, p.c.name == name).returning(p.c.reason, p.c.actor, p.c.paused_at)
    ).first()
    if ended is None:
        return None
    _logged(conn, "resumed", kind, name, actor, reason, _now())
    return ended.reason, ended.actor, ended.paused_at


def _with_held(pause: Pause, held: int) -> Pause:
    return Pause(pause.kind, pause.name, pause.reason, pause.actor, pause.paused_at, held)


def paused_on(conn: Connection) -> list[Pause]:
    """What is paused now, oldest first, each with the pending messages it holds back."""
    found = [
        Pause(r.kind, r.name, r.reason, r.actor, r.paused_at)
        for r in conn.execute(select(p).order_by(p.c.paused_at, p.c.kind, p.c.name))
    ]
    return [_with_held(f, _held_back(conn, f.kind, f.name)) for f in found]


def paused(engine: Engine) -> list[Pause]:
    """What is paused now (queues and handlers), oldest first, with what each holds back."""
    with engine.connect() as conn:
        return paused_on(conn)


def spans_over(
    conn: Connection, targets: Sequence[tuple[str, str]], since: datetime, until: datetime | None
) -> list[PauseSpan]:
    """Pauses of ``targets`` ((kind, name) pairs) that overlapped ``since`` .. ``until`` (None: now).

    Read from the append-only log, a pause paired with the resume that followed
    it; one still in force has no ``resumed_at``.
    """
    if not targets:
        return []
    stmt = select(log).where(or_(*(and_(log.c.kind == k, log.c.name == n) for k, n in targets)))
    opened: dict[tuple[str, str], Any] = {}
    spans: list[PauseSpan] = []
    for row in conn.execute(stmt.order_by(log.c.id)):
        key = (row.kind, row.name)
        if row.event == "paused":
            opened[key] = row
            continue
        start = opened.pop(key, None)
        if start is not None:
            spans.append(
                PauseSpan(
                    row.kind, row.name, start.at, start.actor, start.reason, row.at, row.actor, row.reason
                )
            )
    spans += [PauseSpan(k, n, r.at, r.actor, r.reason) for (k, n), r in opened.items()]
    overlapping = [
        span
        for span in spans
        if (until is None or span.paused_at <= until)
        and (span.resumed_at is None or span.resumed_at >= since)
    ]
    return sorted(overlapping, key=lambda s: s.paused_at)
