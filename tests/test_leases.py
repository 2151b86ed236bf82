"""Lease renewal tells a lost lease from a delivery that finished while the renewal ran.

The heartbeat renews every message the relay holds, on its own connection,
while the outcome writer commits on another: a message whose outcome was
written between the heartbeat's snapshot and its UPDATE is finished, not
lost, and must not raise the "leases were lost" alarm an operator acts on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Outbox, emit
from outbox.relay import Relay
from outbox.relay.leases import LeaseKeeper

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
