"""Attempt outcomes written back: the message rows moved on, one history row per attempt.

A relay writes outcomes in batches, one transaction each (``writer``); this
module holds what a batch is made of and how it is stored. On PostgreSQL the
whole batch goes as one JSON parameter to the database function
``outbox_complete`` (``sql_postgresql.COMPLETE``); on SQLite the statements
below write it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, and_, bindparam, insert, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine

from outbox import outbox_attempt, outbox_message

from .clock import StatementClock

__all__ = ["Completion", "batch_params", "history_insert", "write"]

m = outbox_message
a = outbox_attempt


@dataclass(slots=True)
class Completion:
    """The result of one attempt, written back in batches by :meth:`Store.complete`."""

    message_id: int
    attempt: int
    outcome: str  # an ATTEMPT_OUTCOMES value
    status: str  # the message's next status: delivered, pending (retry), dead, or discarded (expired)
    started_at: datetime
    finished_at: datetime
    retry_in: float = 0.0
    error_type: str | None = None
    error: str | None = None
    detail: dict[str, Any] | None = field(default=None)
    #: a deferral that must not use up an attempt (an open circuit breaker, say)
    refund: bool = False
    #: the destination a deferral waits for (``RetryLater(until_recovered=...)``): released early by
    #: ``outbox_unpark`` when it recovers
    parked_on: str | None = None


_WRITTEN_ONCE = [a.c.message_id, a.c.attempt, a.c.outcome, a.c.started_at]


def history_insert(engine: Engine) -> Any:
    """History rows, each written once: a batch sent again after a lost reply appends nothing.

    The unique index ``ux_outbox_attempt_once`` (message, attempt, outcome and the
    relay's own start stamp) is what a re-sent row collides with, and the only clash
    ignored: any other (an id taken ahead of the sequence) fails the write, loudly.
    """
    if engine.dialect.name == "postgresql":
        return pg_insert(a).on_conflict_do_nothing(index_elements=_WRITTEN_ONCE)
    if engine.dialect.name == "sqlite":
        return sqlite_insert(a).on_conflict_do_nothing(index_elements=_WRITTEN_ONCE)
    return insert(a)


def write(engine: Engine, relay_id: str, clock: StatementClock, results: Sequence[Completion]) -> None:
    """Write a batch of attempt outcomes: message rows updated, history appended, one transaction.

    A message row is only updated while this relay still holds its lease; if
    another relay recovered it meanwhile, the attempt is still recorded (it
    did happen), but the newer owner's state wins.
    """
    if not results:
        return
    now = clock.now()
    ours = and_(
        m.c.id == bindparam("mid"),
        m.c.locked_by == relay_id,
        m.c.status == "running",
        m.c.attempts == bindparam("att", type_=Integer()),
    )
    delivered = [{"mid": r.message_id, "att": r.attempt} for r in results if r.status == "delivered"]
    retry = [
        {
            "mid": r.message_id,
            "att": r.attempt,
            "err": r.error,
            "later": clock.bind_later(timedelta(seconds=r.retry_in)),
            "refund": int(r.refund),
            "parked": r.parked_on,
        }
        for r in results
        if r.status == "pending"
    ]
    # Ended without delivery: dead, or discarded (expired, never handed to the handler).
    ended: dict[str, list[dict[str, Any]]] = {"dead": [], "discarded": []}
    for r in results:
        if r.status in ended:
            ended[r.status].append({"mid": r.message_id, "att": r.attempt, "err": r.error})
    with engine.begin() as conn:
        if delivered:
            conn.execute(
                update(m)
                .where(ours)
                .values(
                    status="delivered",
                    delivered_at=now,
                    parked_on=None,
                    locked_by=None,
                    locked_until=None,
                    updated_at=now,
                ),
                delivered,
            )
        if retry:
            conn.execute(
                update(m)
                .where(ours)
                .values(
                    status="pending",
                    available_at=clock.later("later"),
                    last_error=bindparam("err"),
                    attempts=m.c.attempts - bindparam("refund", type_=Integer()),
                    parked_on=bindparam("parked"),
                    locked_by=None,
                    locked_until=None,
                    updated_at=now,
                ),
                retry,
            )
        for status, rows in ended.items():
            if rows:
                conn.execute(
                    update(m)
                    .where(ours)
                    .values(
                        status=status,
                        last_error=bindparam("err"),
                        parked_on=None,
                        locked_by=None,
                        locked_until=None,
                        updated_at=now,
                    ),
                    rows,
                )
        conn.execute(
            history_insert(engine),
            [
                {
                    "message_id": r.message_id,
                    "attempt": r.attempt,
                    "outcome": r.outcome,
                    "started_at": r.started_at,
                    "finished_at": r.finished_at,
                    "duration_ms": int((r.finished_at - r.started_at).total_seconds() * 1000),
                    "relay_id": relay_id,
                    "error_type": r.error_type,
                    "error": r.error,
                    "detail": r.detail,
                }
                for r in results
            ],
        )


def batch_params(relay_id: str, results: Sequence[Completion]) -> dict[str, Any]:
    """The parameters of ``sql_postgresql.COMPLETE``: the whole batch as one JSON document.

    The database holds the start and finish times sent here between the claim's
    time (as it recorded it) and its own clock at the write: this host's clock
    can make them less precise, never older or newer than what happened.
    """
    batch: list[dict[str, Any]] = [
        {
            "id": r.message_id,
            "attempt": r.attempt,
            "status": r.status,
            "outcome": r.outcome,
            "error": r.error,
            "error_type": r.error_type,
            "delay": float(r.retry_in),
            "refund": int(r.refund),
            # Seconds since the epoch: a float costs the encoder far less than an ISO string.
            "started": r.started_at.timestamp(),
            "finished": r.finished_at.timestamp(),
            "duration_ms": int((r.finished_at - r.started_at).total_seconds() * 1000),
            "detail": r.detail,
        }
        for r in results
    ]
    for entry, r in zip(batch, results, strict=True):
        if r.parked_on is not None:  # rare: most batches carry no such key at all
            entry["parked_on"] = r.parked_on
    # ASCII-escaped JSON: text the database cannot take (a lone surrogate) is then refused by
    # the database, which the writer isolates, instead of failing to encode on the way out.
    return {"me": relay_id, "batch": json.dumps(batch, allow_nan=False)}
