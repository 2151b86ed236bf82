"""Every query the relay runs, for PostgreSQL and SQLite; the outcome writes are in ``outcomes``.

On PostgreSQL every write is a call of a database function (``sql_postgresql``,
migration ``outbox_0015``) that runs as the tables' owner and stamps the
history it appends with the server's clock and the relay's login: the relay's
role needs EXECUTE on them, not UPDATE or INSERT on the outbox tables. SQLite
has no roles; there the same changes are SQLAlchemy statements below, with the
relay's own UTC clock as "now" (``clock``).

On PostgreSQL ``FOR UPDATE SKIP LOCKED`` lets any number of relays claim from
one table without waiting on or double-claiming each other's rows. SQLite
ignores row locks; it serialises writers, and one relay process at a time is
the documented limit there.

Methods are synchronous and short; the relay runs them in threads. The
payload and headers its claims and recoveries read are decoded by the relay
(``documents.py``), not by the driver, so a document that cannot be decoded
makes its message dead instead of failing the whole claim or recovery.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import ColumnElement, Row, and_, exists, func, or_, select, text, tuple_, update
from sqlalchemy.engine import Engine

from outbox import outbox_attempt, outbox_message, outbox_pause

from . import outcomes
from . import sql_postgresql as pg
from .claim_position import FRONT, Position
from .claimed import CLAIMED
from .clock import StatementClock
from .db import LoopConnection
from .outcomes import Completion

__all__ = ["Completion", "GroupPolicy", "Store"]

GroupPolicy = Literal["block", "skip"]

m = outbox_message
a = outbox_attempt


def _in_claim_order(rows: list[Any]) -> list[Any]:
    """``UPDATE ... RETURNING`` answers in no set order; dispatch and the claim position want the claim's."""
    rows.sort(key=lambda r: (r.priority, r.id))
    return rows


class Store:
    def __init__(self, engine: Engine, relay_id: str, *, lease: float, group_policy: GroupPolicy) -> None:
        self.engine = engine
        self.relay_id = relay_id
        self.lease = timedelta(seconds=lease)
        self.group_policy = group_policy
        self.clock = StatementClock(engine)
        #: PostgreSQL: every write is one function call, in autocommit (``sql_postgresql``).
        self.in_database = self.clock.server_clock
        # psycopg: the hot path runs on the event loop's own connections (``LoopConnection``).
        self.fast = self.in_database and engine.dialect.driver == "psycopg"
        #: the same engine in autocommit: each function call is its own transaction
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._calls: pg.Calls | None = None

    def calls(self) -> pg.Calls:
        """The calls of the relay's database functions, named with their schema (looked up once).

        Named, so that the hot-path connections can run on the functions' own
        pinned search path (``sql_postgresql.PINNED_PATH``). The start-up check
        looks them up, so the event loop never waits on it.
        """
        if self._calls is None:
            with self.engine.connect() as conn:
                found = conn.exec_driver_sql(pg.FUNCTIONS_SCHEMA).first()
                self._calls = pg.calls(*found) if found is not None else pg.calls(None)
        return self._calls

    @property
    def notify_schema(self) -> str | None:
        """The schema this relay's NOTIFY payloads name, once :meth:`calls` has looked it up (else None)."""
        return self._calls.schema_name if self._calls is not None else None

    # -- liveness ---------------------------------------------------------------

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(select(1))

    # -- claiming -----------------------------------------------------------------

    def pending_queues(self) -> list[str]:
        """Distinct queues with pending rows, by a loose index scan of the claim index.

        A relay serving "every queue" must also find queues named only at emit
        time (``emit(..., queue=...)``); a recursive min() walk touches one index
        entry per queue instead of the whole pending backlog.
        """
        if self.fast:
            with self.autocommit.connect() as conn:
                return [q for (q,) in conn.exec_driver_sql(pg.PENDING_QUEUES)]
        pending = m.c.status == "pending"
        first = select(func.min(m.c.queue).label("queue")).where(pending).cte("queues", recursive=True)
        following = select(
            select(func.min(m.c.queue)).where(pending, m.c.queue > first.c.queue).scalar_subquery()
        ).where(first.c.queue.is_not(None))
        walk = first.union_all(following)
        with self.engine.connect() as conn:
            return [q for (q,) in conn.execute(select(walk.c.queue).where(walk.c.queue.is_not(None)))]

    def claim(
        self, queue: str, handlers: Sequence[str], limit: int, start: Position = None
    ) -> list[Row[Any]]:
        """Lease up to ``limit`` due messages of ``queue`` for ``handlers``, unless paused.

        The attempt is counted here, at claim time, so a message that kills its
        relay still uses up attempts and eventually goes dead instead of
        crashing relays forever. Rows sorting before ``start`` are left for a
        claim from the front (``relay/claim_position.py``). Each row also
        carries ``claimed_at``, the claim's "now" (``clock``), by which the
        relay judges whether it has expired (``dispatch.expired``).

        On psycopg the relay claims with :meth:`claim_on`; here the same
        call runs through the engine for callers outside the relay (tests,
        scripts), and the driver decodes its documents.
        """
        if limit <= 0 or not handlers:
            return []
        if self.in_database:
            params = self._claim_params(queue, handlers, limit, start)
            with self.autocommit.connect() as conn:
                fast_rows = list(conn.exec_driver_sql(self.calls().claim, params))
            return _in_claim_order(fast_rows)
        now = self.clock.now()
        due = (
            select(m.c.id)
            .where(
                m.c.status == "pending",
                m.c.queue == queue,
                m.c.handler.in_(handlers),
                tuple_(m.c.priority, m.c.id) >= tuple_(*(start or FRONT)),
                m.c.available_at <= now,
                *self._not_paused(queue),
                self._group_is_free(),
            )
            .order_by(m.c.priority, m.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        claim = (
            update(m)
            .where(m.c.id.in_(due.scalar_subquery()))
            .values(
                status="running",
                locked_by=self.relay_id,
                locked_until=self.clock.later("lease"),
                attempts=m.c.attempts + 1,
                updated_at=now,
            )
            .returning(*CLAIMED, now.label("claimed_at"))
        )
        with self.engine.begin() as conn:
            rows = list(conn.execute(claim, {"lease": self.clock.bind_later(self.lease)}))
        return _in_claim_order(rows)

    def first_due_before(
        self, queue: str, handlers: Sequence[str], before: tuple[int, int]
    ) -> tuple[int, int] | None:
        """(priority, id) of the first row a claim of ``queue`` would take that sorts before ``before``.

        A plain read under the claim's own conditions (due, not paused, its
        group free), locking nothing: a listening relay's look behind its
        claim position (``relay/claim_position.py``). PostgreSQL only.
        """
        params = {
            "queue": queue,
            "handlers": list(handlers),
            "before_priority": before[0],
            "before_id": before[1],
            "block_on_dead": self.group_policy == "block",
        }
        with self.engine.begin() as conn:
            # As outbox_claim (outbox_0023): from the position in the claim index, never every
            # pending entry of the status index, sorted: under a held horizon that is every row since.
            conn.exec_driver_sql("SET LOCAL enable_sort = off")
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            row = conn.exec_driver_sql(self.calls().first_due, params).first()
        return None if row is None else (int(row[0]), int(row[1]))

    def _claim_params(
        self, queue: str, handlers: Sequence[str], limit: int, start: Position
    ) -> dict[str, Any]:
        return {
            "me": self.relay_id,
            "lease": self.lease.total_seconds(),
            "queue": queue,
            "handlers": list(handlers),
            "limit": limit,
            "block_on_dead": self.group_policy == "block",
            **pg.claim_start(start),
        }

    async def claim_on(
        self, conn: LoopConnection, queue: str, handlers: Sequence[str], limit: int, start: Position = None
    ) -> list[Any]:
        """:meth:`claim` over the event loop's own connection (PostgreSQL with psycopg only)."""
        if limit <= 0 or not handlers:
            return []
        return _in_claim_order(
            await conn.fetch(self.calls().claim, self._claim_params(queue, handlers, limit, start))
        )

    @staticmethod
    def _not_paused(queue: str) -> list[ColumnElement[bool]]:
        """Neither the queue nor the message's handler is paused (``outbox pause``).

        The same shape as the PostgreSQL claim (``sql_postgresql``): the queue's
        pause once per claim, the handler's an anti-join against a table of a
        few rows.
        """
        p = outbox_pause
        queue_paused = exists().where(p.c.kind == "queue", p.c.name == queue)
        handler_paused = exists().where(p.c.kind == "handler", p.c.name == m.c.handler)
        return [~queue_paused, ~handler_paused]

    def _group_is_free(self) -> ColumnElement[bool]:
        """A grouped message is due only when no earlier message of its group is unfinished.

        "Earlier" is id order among committed rows, per route. Under the
        ``block`` policy a dead message also holds its group back until an
        operator discards or requeues it; under ``skip`` the group moves on.
        """
        earlier = m.alias("earlier")
        holding = ("pending", "running", "dead") if self.group_policy == "block" else ("pending", "running")
        blocked = exists().where(
            earlier.c.handler == m.c.handler,
            earlier.c.group_key == m.c.group_key,
            earlier.c.id < m.c.id,
            earlier.c.status.in_(holding),
        )
        return or_(m.c.group_key.is_(None), ~blocked)

    # -- leases -------------------------------------------------------------------

    def extend(self, ids: Iterable[int]) -> set[int]:
        """Renew the lease on messages still being worked on; returns the ids that were still ours.

        On PostgreSQL a row another transaction has locked is skipped, never
        waited for. The one holding it is nearly always this relay's own outcome
        writer, on its own connection, finishing that very row: its batched
        ``UPDATE`` locks rows in the order their outcomes came in, where this one
        took them in the table's order, so each could hold a row the other
        waited for, a deadlock the database broke by failing one of them. A
        locked row needs no renewal meanwhile: the lease recovery skips locked
        rows as well, so no relay can take it back while the lock lasts, and the
        next renewal finds it finished or free. Skipped rows still count as ours
        (the statement's snapshot says whose they are), so they are not reported
        lost. One statement, as before: the renewal is a data-modifying CTE.
        """
        ids = list(ids)
        if not ids:
            return set()
        if self.in_database:
            params = {"me": self.relay_id, "ids": ids, "lease": self.lease.total_seconds()}
            with self.autocommit.connect() as conn:
                return set(conn.exec_driver_sql(self.calls().extend, params).scalars())
        ours = and_(m.c.id.in_(ids), m.c.locked_by == self.relay_id, m.c.status == "running")
        renew = update(m).values(locked_until=self.clock.later("lease")).returning(m.c.id)
        # SQLite has no row locks: it runs one writer at a time.
        with self.engine.begin() as conn:
            return set(
                conn.execute(renew.where(ours), {"lease": self.clock.bind_later(self.lease)}).scalars()
            )

    def release(self, claims: Iterable[tuple[int, int]]) -> int:
        """Hand back claims whose attempt never started: not an attempt, so the count is restored.

        Each claim is named by (id, attempt), as this relay claimed it: the
        attempt number changes with every claim of a row, so a release can
        only ever undo the claim it names, never a claim of the same row that
        another process made under the same relay id (a crashed earlier run,
        say), whose attempt must stay counted.
        """
        claims = list(claims)
        if not claims:
            return 0
        if self.in_database:
            params = {"me": self.relay_id, "ids": [i for i, _ in claims], "attempts": [a for _, a in claims]}
            with self.autocommit.connect() as conn:
                released = int(conn.exec_driver_sql(self.calls().release, params).scalar_one())
                if released:
                    # Listening relays may have claimed past these rows: this sends them to the front.
                    conn.exec_driver_sql(self.calls().released)
                return released
        stmt = (
            update(m)
            .where(
                m.c.locked_by == self.relay_id,
                m.c.status == "running",
                tuple_(m.c.id, m.c.attempts).in_(claims),
            )
            .values(
                status="pending",
                locked_by=None,
                locked_until=None,
                attempts=m.c.attempts - 1,
                updated_at=self.clock.now(),
            )
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount

    # -- outcomes -----------------------------------------------------------------

    def complete(self, results: Sequence[Completion]) -> None:
        """Write a batch of attempt outcomes in one transaction (see :func:`outcomes.write`)."""
        if not results:
            return
        if self.in_database:
            with self.autocommit.connect() as conn:
                conn.exec_driver_sql(self.calls().complete, outcomes.batch_params(self.relay_id, results))
            return
        outcomes.write(self.engine, self.relay_id, self.clock, results)

    async def complete_on(self, conn: LoopConnection, results: Sequence[Completion]) -> None:
        """:meth:`complete` over the event loop's own connection (PostgreSQL with psycopg only)."""
        if results:
            await conn.execute(self.calls().complete, outcomes.batch_params(self.relay_id, results))

    # -- history partitions -------------------------------------------------------------

    def history_partitions_ahead(self, days: int) -> int | None:
        """PostgreSQL: make the history partitions of today and the next ``days`` days (outbox_0024).

        Returns how many the database created (0 when they all existed); None on
        SQLite, whose history is one table. Its own short transaction.
        """
        if not self.in_database:
            return None
        with self.autocommit.connect() as conn:
            created = conn.execute(text("SELECT outbox_history_partitions_ahead(:days)"), {"days": days})
            return int(created.scalar_one())

    # -- visibility -----------------------------------------------------------------

    def waiting_for_unknown_handlers(self, known: Sequence[str]) -> dict[str, int]:
        """Pending messages for routes this relay has no handler for (a rolling deploy, a typo)."""
        stmt = (
            select(m.c.handler, func.count())
            .where(m.c.status == "pending", m.c.handler.not_in(known))
            .group_by(m.c.handler)
        )
        with self.engine.connect() as conn:
            return {h: n for h, n in conn.execute(stmt)}
