"""Retention: ``purge`` deletes finished messages, old history and expired inbox markers.

In short batches, each its own transaction, all recorded in one ``outbox_retention_run`` row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import ColumnElement, and_, delete, insert, literal, or_, select, text, tuple_, update
from sqlalchemy.engine import Connection, Engine, Row
from sqlalchemy.exc import DBAPIError

from .._tables import outbox_inbox, outbox_retention_run, status_is_one_of
from ._base import (
    ACTOR_LIMIT,
    InvalidRequest,
    OpsError,
    _before,
    _has_copy,
    _now,
    a,
    m,
)
from ._in_database import missing_or_forbidden
from ._retention import history_purge_allowed

run = outbox_retention_run


#: The youngest history a purge may delete. On PostgreSQL the purge functions enforce it.
MIN_HISTORY_AGE: Final = timedelta(days=1)
#: The largest batch a purge takes: each batch is one transaction, and these must stay short.
MAX_PURGE_BATCH: Final = 10000
#: How often a step that found the history table busy is tried (PostgreSQL: lock timeout, deadlock).
_LOCK_TRIES: Final = 5
_LOCK_BUSY: Final = frozenset({"55P03", "40P01"})


@dataclass(frozen=True, slots=True)
class PurgeResult:
    messages: int
    attempts: int
    batches: int
    run_id: int | None = None  # the purge's outbox_retention_run row
    markers: int = 0  # inbox markers past their kept_until


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

    On PostgreSQL history lives in daily partitions (migration ``outbox_0024``):
    the history cutoff is rounded down to midnight UTC of the day it falls in,
    and each day older than that is dropped whole, in one step whatever
    ``batch_size`` says (its count is still added to the record in the same
    transaction), after the history of unresolved messages is set aside in the
    DEFAULT partition; only rows in the DEFAULT partition are deleted in batches.

    Purging a delivered message also forgets its idempotency key: the same key
    emitted afterwards is stored (and delivered) again.

    Every run also deletes the inbox markers (``outbox_inbox``) whose
    ``kept_until`` had passed when it started: each inbox's own ``keep``
    decides, no cutoff given here can reach a marker inside its window. They
    are counted in the run's ``markers_deleted`` (``outbox_inbox_purge_step``
    on PostgreSQL, migration ``outbox_0020``).
    """
    if not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_PURGE_BATCH:
        raise InvalidRequest(f"batch_size must be 1 to {MAX_PURGE_BATCH}, got {batch_size!r}")
    if not isinstance(actor, str) or not actor.strip():
        raise InvalidRequest("an actor is required: it is what outbox_retention_run will say")
    if len(actor) > ACTOR_LIMIT:
        raise InvalidRequest(f"the actor is longer than {ACTOR_LIMIT} characters; give a shorter name")
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
    messages = attempts = markers = batches = 0
    steps: list[Callable[[], tuple[int, int, int]]] = [
        lambda: (*store.step(run_id, batch_size), 0),
        lambda: (0, 0, store.markers_step(run_id, batch_size)),
    ]
    for step in steps:
        while True:
            deleted_messages, deleted_attempts, deleted_markers = step()
            if not (deleted_messages or deleted_attempts or deleted_markers):
                break
            messages += deleted_messages
            attempts += deleted_attempts
            markers += deleted_markers
            batches += 1
            if on_batch is not None:
                on_batch(PurgeResult(messages, attempts, batches, run_id, markers))
    store.finish(run_id)
    return PurgeResult(messages, attempts, batches, run_id, markers)


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

    def markers_step(self, run_id: int, batch_size: int) -> int:
        """Expired inbox markers deleted by one batch; 0 when none is left."""
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
            known = missing_or_forbidden(error, "outbox_purge", "outbox purge functions")
            if known is not None:
                raise known from None
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
        # A step that drops a day of history (outbox_0024) needs the history table's lock for a
        # moment, and waits 2 s at most for it: a busy table is tried again, a few times.
        for attempt in range(1, _LOCK_TRIES + 1):
            try:
                row = self._call(
                    "SELECT messages_deleted, attempts_deleted FROM outbox_purge_step(:run, :batch)",
                    run=run_id,
                    batch=batch_size,
                )
            except DBAPIError as error:
                if attempt == _LOCK_TRIES or getattr(error.orig, "sqlstate", None) not in _LOCK_BUSY:
                    raise
                time.sleep(attempt)
                continue
            return int(row.messages_deleted), int(row.attempts_deleted)
        raise AssertionError("unreachable")

    def markers_step(self, run_id: int, batch_size: int) -> int:
        row = self._call("SELECT outbox_inbox_purge_step(:run, :batch)", run=run_id, batch=batch_size)
        return int(row[0])

    def finish(self, run_id: int) -> None:
        self._call("SELECT outbox_purge_finish(:run)", run=run_id)


def _unresolved() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row still waiting on a relay or an operator.

    A dead message counts as resolved once someone requeued it (a copy points
    at it, or its history says so), like the dead figure of :func:`stats`.
    """
    requeued = select(a.c.id).where(a.c.message_id == m.c.id, a.c.outcome == "requeued").exists()
    return or_(
        status_is_one_of("pending", "running"),
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

    def markers_step(self, run_id: int, batch_size: int) -> int:
        i = outbox_inbox
        with self.engine.begin() as conn, history_purge_allowed(conn, run_id):
            record = self._open_run(conn, run_id)
            cutoff = literal(record.started_at, i.c.kept_until.type)
            expired = list(
                conn.execute(
                    select(i.c.consumer, i.c.message_id)
                    .where(i.c.kept_until < cutoff)
                    .order_by(i.c.kept_until)
                    .limit(batch_size)
                )
            )
            if not expired:
                return 0
            deleted = conn.execute(
                delete(i).where(tuple_(i.c.consumer, i.c.message_id).in_([tuple(r) for r in expired]))
            ).rowcount
            self._add(conn, run_id, "markers_deleted", deleted)
            return deleted

    def finish(self, run_id: int) -> None:
        with self.engine.begin() as conn:
            self._open_run(conn, run_id)
            conn.execute(update(run).where(run.c.id == run_id).values(finished_at=_now()))
