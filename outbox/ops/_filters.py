"""Which messages an operation reads or acts on: ``MessageFilter``, candidates, batches.

Nothing here locks: the operator's role holds no UPDATE on ``outbox_message``
(which every row lock needs). Whatever acts on a row locks it and checks its
state again first: the database functions of ``outbox_0014`` on PostgreSQL,
SQLite's single writer there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Select, func, literal, select
from sqlalchemy.engine import Connection, Engine, Row

from ._base import (
    DISCARDABLE,
    REQUEUABLE,
    RESENDABLE,
    InvalidRequest,
    NotFound,
    OpsError,
    _has_copy,
    _needs_decision,
    _now,
    a,
    m,
)
from ._where import PayloadEquals


@dataclass(frozen=True, slots=True)
class MessageFilter:
    """Equality filters plus a created-at window; every field optional, all of them must hold.

    ``payload`` holds conditions on values inside the payload
    (:func:`parse_where` reads the command line's ``payload.PATH=VALUE``).
    ``needs_decision`` keeps the dead messages nobody has requeued yet, the
    ones :func:`stats` counts as ``dead``: a requeued original stays ``dead``
    for the record, and a status filter alone cannot tell it apart.
    """

    status: str | None = None
    handler: str | None = None
    event_type: str | None = None
    queue: str | None = None
    key: str | None = None
    group_key: str | None = None
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    created_since: datetime | None = None
    created_before: datetime | None = None
    ids: Sequence[int] = field(default_factory=tuple)
    payload: Sequence[PayloadEquals] = field(default_factory=tuple)
    needs_decision: bool = False

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        from .._tables import MESSAGE_STATUSES

        if self.status is not None and self.status not in MESSAGE_STATUSES:
            raise InvalidRequest(f"unknown status {self.status!r}; one of {', '.join(MESSAGE_STATUSES)}")
        if self.needs_decision and self.status not in (None, "dead"):
            raise InvalidRequest(
                f"only dead messages need a decision; needs_decision cannot match status {self.status!r}"
            )
        for column, value in (
            (m.c.status, self.status),
            (m.c.handler, self.handler),
            (m.c.event_type, self.event_type),
            (m.c.queue, self.queue),
            (m.c.idempotency_key, self.key),
            (m.c.group_key, self.group_key),
            (m.c.aggregate_type, self.aggregate_type),
            (m.c.aggregate_id, self.aggregate_id),
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
        if self.needs_decision:
            stmt = stmt.where(*_needs_decision())
        return stmt

    @property
    def empty(self) -> bool:
        return not (
            self.ids
            or self.payload
            or self.needs_decision
            or any(
                v is not None
                for v in (
                    self.status,
                    self.handler,
                    self.event_type,
                    self.queue,
                    self.key,
                    self.group_key,
                    self.aggregate_type,
                    self.aggregate_id,
                    self.created_since,
                    self.created_before,
                )
            )
        )


def _named(
    conn: Connection,
    where: MessageFilter,
    allowed: tuple[str, ...],
    verb: str,
    columns: Sequence[Any],
    hints: Mapping[str, str] | None = None,
) -> list[Row[Any]]:
    """The rows of named ids; every id must exist and have an allowed status, or none is acted on.

    A running message belongs to a relay, which must never wait for an
    operator's refused command: what is refused here is never locked, and
    what acts on the rest locks them and checks again (``strict``).
    ``hints``: what to say, after the refusal, about a status that is refused.
    """
    found: dict[int, str] = {r.id: r.status for r in conn.execute(where.apply(select(m.c.id, m.c.status)))}
    missing = [i for i in where.ids if i not in found]
    if missing:
        raise NotFound(f"no message with id {', '.join(map(str, missing))}")
    wrong = sorted((i, s) for i, s in found.items() if s not in allowed)
    if wrong:
        listed = ", ".join(f"{i} ({s})" for i, s in wrong)
        refused = {s for _, s in wrong}
        said = dict.fromkeys(hint for status, hint in (hints or {}).items() if status in refused)
        raise OpsError(
            f"can only {verb} {' or '.join(allowed)} messages; not {listed}"
            + "".join(f"; {hint}" for hint in said)
        )
    stmt = where.apply(select(*columns)).where(m.c.status.in_(allowed))
    return _all_or_none(conn, stmt, found, "changed status meanwhile")


def _all_or_none(conn: Connection, stmt: Select[Any], found: Iterable[int], change: str) -> list[Row[Any]]:
    """The rows ``stmt`` still selects; all of ``found`` must be among them, or none is acted on."""
    stmt = stmt.order_by(m.c.id)
    rows = list(conn.execute(stmt))
    changed = sorted(set(found) - {r.id for r in rows})
    if changed:  # a relay claimed it, or another operator acted, between the two reads
        raise OpsError(f"message {', '.join(map(str, changed))} {change}; try again")
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
    (running ones above all: they belong to a relay) are never loaded. Each
    batch is committed before the next is read, so the locks its action takes
    are held briefly and memory stays bounded however many rows match.
    """
    if where.empty:
        raise InvalidRequest(f"refusing to {verb} every message: give ids or a filter")
    after = 0
    while True:
        with engine.begin() as conn:
            stmt = (
                where.apply(select(*columns))
                .where(m.c.status.in_(allowed), m.c.id > after, *extra)
                .order_by(m.c.id)
                .limit(batch_size)
            )
            rows = list(conn.execute(stmt))
            if not rows:
                return
            yield conn, rows
        after = rows[-1].id


def _tried() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row with history: attempted before (ix_outbox_attempt_message_id)."""
    return select(a.c.id).where(a.c.message_id == m.c.id).exists()


def _waiting(now: datetime, include_delayed: bool) -> list[ColumnElement[bool]]:
    """Pending and not due yet; unless ``include_delayed``, also attempted before (a backoff, not a delay)."""
    waiting = [m.c.status == "pending", m.c.available_at > literal(now, m.c.available_at.type)]
    return waiting if include_delayed else [*waiting, _tried()]


def _candidates(where: MessageFilter, verb: str, include_delayed: bool = False) -> Select[Any]:
    if where.empty:
        raise InvalidRequest(f"refusing to {verb} every message: give ids or a filter")
    if verb == "requeue":
        return where.apply(select(m.c.id)).where(m.c.status.in_(REQUEUABLE), ~_has_copy())
    if verb == "resend":
        return where.apply(select(m.c.id)).where(m.c.status.in_(RESENDABLE))
    if verb == "discard":
        return where.apply(select(m.c.id)).where(m.c.status.in_(DISCARDABLE))
    if verb in ("retry-now", "retry_now"):
        return where.apply(select(m.c.id)).where(*_waiting(_now(), include_delayed))
    raise InvalidRequest(f"unknown action {verb!r}; one of requeue, resend, discard, retry-now")


def requeue_candidates(engine: Engine, where: MessageFilter) -> list[int]:
    """The ids a filter-based :func:`requeue` would copy now."""
    return candidate_ids(engine, where, "requeue")


def candidate_ids(engine: Engine, where: MessageFilter, verb: str, *, limit: int | None = None) -> list[int]:
    """The ids a filter-based ``requeue``, ``resend``, ``discard`` or ``retry-now`` would take, oldest first.

    A confirmation that states a count then acts on exactly these ids (named
    ids are all or none), so a message that dies after the question is not
    swept in unseen. ``limit`` caps the read.
    """
    stmt = _candidates(where, verb).order_by(m.c.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    with engine.connect() as conn:
        return list(conn.execute(stmt).scalars())


def count_candidates(
    engine: Engine, where: MessageFilter, verb: str, *, include_delayed: bool = False
) -> int:
    """How many messages a filter-based ``requeue``, ``resend``, ``discard`` or ``retry-now`` would take now.

    What a confirmation prompt counts, without loading the rows.
    ``include_delayed`` is :func:`retry_now`'s.
    """
    candidates = _candidates(where, verb, include_delayed).subquery()
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(candidates)).scalar_one())
