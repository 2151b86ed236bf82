"""Lease renewal tells a lost lease from a delivery that finished while the renewal ran, and never deadlocks.

The heartbeat renews every message the relay holds, on its own connection,
while the outcome writer commits on another: a message whose outcome was
written between the heartbeat's snapshot and its UPDATE is finished, not
lost, and must not raise the "leases were lost" alarm an operator acts on.
And a renewal over the rows a write is completing must not wait for them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Outbox, emit
from outbox.relay import Relay
from outbox.relay.db import LoopConnection
from outbox.relay.leases import LeaseKeeper
from outbox.relay.outcomes import Completion

m = outbox.outbox_message


class RunContext:
    """What LeaseKeeper uses of the relay's run context: its store, its id, a way to run store calls."""

    def __init__(self, relay: Relay) -> None:
        self.store = relay.store
        self.id = relay.id

    async def db(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)


def test_only_leases_still_held_and_taken_by_another_relay_count_as_lost(engine, caplog):
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="ledger")
    maker: sessionmaker[Session] = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            for n in range(3):
                emit(s, "order.paid", {"n": n}, key=f"order:{n}")
        relay = Relay(ob, engine, relay_id="r1")
        finished, taken, running = (r.id for r in relay.store.claim("default", ["ledger"], 3))
    finally:
        ob.uninstall(maker)

    def held() -> list[int]:
        if not snapshots:
            # The writer commits `finished` right after the heartbeat's snapshot, and
            # another relay recovers `taken` (its lease lapsed while this one stalled).
            with engine.begin() as conn:
                conn.execute(update(m).where(m.c.id == finished).values(status="delivered", locked_by=None))
                conn.execute(update(m).where(m.c.id == taken).values(locked_by="r2"))
            snapshots.append([finished, taken, running])
            return [finished, taken, running]
        return [taken, running]  # the writer has let go of `finished`

    snapshots: list[list[int]] = []
    keeper = LeaseKeeper(RunContext(relay), lease=30.0, held_ids=held)  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    assert asyncio.run(keeper.renew_once()) == [taken]
    [warning] = [r for r in caplog.records if getattr(r, "action", None) == "lease_lost"]
    assert warning.getMessage().startswith("1 of 3 leases were lost")
    with engine.connect() as conn:
        locks = dict(conn.execute(select(m.c.id, m.c.locked_by)).all())
    assert locks == {finished: None, taken: "r2", running: "r1"}


def test_a_renewal_and_an_outcome_write_over_the_same_rows_never_deadlock(pg_url: str):
    """The heartbeat renews the rows the writer is completing, on another connection, in another order.

    The batched write locks its rows in the order the outcomes came in (3, 2, 1 here); the
    renewal used to lock them in the table's order (1, then 3). With the write held up on a
    row of its own batch (2, locked by a third transaction), the renewal took 1 and waited
    for 3, which the write holds, while the write went on to wait for 1: a deadlock, and
    the database aborted one of them ("could not record 22 outcome(s) (deadlock detected)").
    """
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # new connections report a deadlock after 50 ms, not 1 s
        conn.execute(text(f"ALTER DATABASE \"{admin.url.database}\" SET deadlock_timeout = '50ms'"))
    admin.dispose()
    engine = create_engine(pg_url)
    try:
        ob = Outbox()
        ob.route("order.paid", lambda msg: None, name="ledger")
        maker: sessionmaker[Session] = sessionmaker(engine)
        ob.install(maker)
        try:
            with maker.begin() as s:
                for n in range(3):
                    emit(s, "order.paid", {"n": n})
        finally:
            ob.uninstall(maker)
        relay = Relay(ob, engine, relay_id="r1")
        claimed = relay.store.claim("default", ["ledger"], 3)
        first, middle, last = sorted(r.id for r in claimed)
        with engine.connect() as conn:
            in_table_order = conn.execute(select(m.c.id).order_by(text("ctid"))).scalars().all()
        assert in_table_order == [first, middle, last], "the renewal must meet the rows in id order"
        by_id = {r.id: r for r in claimed}
        now = datetime.now(UTC)
        outcomes = [
            Completion(i, by_id[i].attempts, "delivered", "delivered", now, now)
            for i in (last, middle, first)
        ]

        async def race() -> tuple[BaseException | None, set[int] | BaseException]:
            writer = LoopConnection(engine, "outbox-relay write")
            with engine.connect() as holder:
                holder.execute(select(m.c.id).where(m.c.id == middle).with_for_update())
                writing = asyncio.create_task(relay.store.complete_on(writer, outcomes))
                await _waiting_for_locks(engine, 1)  # the write holds `last` and waits for `middle`
                renewing = asyncio.create_task(asyncio.to_thread(relay.store.extend, [first, last]))
                await _waiting_for_locks(engine, 2, unless=renewing)
                holder.rollback()  # the write goes on to `first`
            wrote, renewed = await asyncio.gather(writing, renewing, return_exceptions=True)
            await writer.close()
            return (wrote if isinstance(wrote, BaseException) else None), renewed

        write_error, renewed = asyncio.run(race())
        assert write_error is None, f"the outcome write failed: {write_error}"
        assert not isinstance(renewed, BaseException), f"the renewal failed: {renewed}"
        assert renewed == {first, last}, "both rows were still this relay's when the renewal looked"
        with engine.connect() as conn:
            statuses = dict(conn.execute(select(m.c.id, m.c.status)).all())
        assert statuses == dict.fromkeys((first, middle, last), "delivered")
    finally:
        engine.dispose()


async def _waiting_for_locks(
    engine: Engine, count: int, *, unless: asyncio.Future[Any] | None = None
) -> None:
    """Until ``count`` connections to the database wait for a lock (or ``unless`` is done)."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + 20
    while not (unless is not None and unless.done()):
        with engine.connect() as conn:
            if conn.execute(query).scalar_one() >= count:
                return
        assert time.monotonic() < deadline, f"{count} connection(s) never came to wait for a lock"
        await asyncio.sleep(0.02)
