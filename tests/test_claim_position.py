"""During a backlog the relay claims from its position in the queue, and still serves what sorts before it.

On PostgreSQL the claim index keeps a dead entry for every claimed row until a
vacuum, so claims start where the last full one did (relay/claim_position.py).
What sorts before that position (a retry that came due, a transaction that
took its id early and committed late, a higher priority) must still be
delivered within about a second, long before the backlog ends.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from invoices import Base, Invoice
from relayproc import wait_until
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import RetryLater, emit, signals
from outbox.relay import Relay
from outbox.relay.claim_position import FRONT_SCAN_EVERY, ClaimPositions

m = outbox.outbox_message
a = outbox.outbox_attempt

BACKLOG = 1_500
CONCURRENCY = 10
HANDLER_SECONDS = 0.02  # with CONCURRENCY, at most 500 deliveries a second: a clock the test can count on
#: Deliveries that may happen between a row becoming claimable and its own delivery: a front
#: scan comes at most FRONT_SCAN_EVERY later, which at 500 a second is 500 deliveries; twice that.
WITHIN = int(2 * FRONT_SCAN_EVERY * CONCURRENCY / HANDLER_SECONDS)


def rows(*positions: tuple[int, int]) -> list[Any]:
    return [SimpleNamespace(priority=p, id=i) for p, i in positions]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_full_claim_sets_the_position_and_a_short_one_clears_it():
    clock = Clock()
    positions = ClaimPositions(clock)
    assert positions.start("q") is None  # nothing known: from the front
    positions.claimed("q", None, rows((0, 10), (0, 11), (5, 3)), limit=3, seconds=0.001)
    assert positions.start("q") == (0, 10)
    assert positions.start("other") is None  # per queue
    positions.claimed("q", (0, 10), rows((0, 12), (0, 13), (0, 14)), limit=3, seconds=0.001)
    assert positions.start("q") == (0, 12)
    positions.claimed("q", (0, 12), rows((0, 15)), limit=3, seconds=0.001)  # the backlog ran out
    assert positions.start("q") is None


def test_a_backlog_is_claimed_from_the_front_again_once_front_scan_every_has_passed():
    clock = Clock()
    positions = ClaimPositions(clock)
    positions.claimed("q", None, rows((0, 1), (0, 2)), limit=2, seconds=0.001)
    clock.now += FRONT_SCAN_EVERY / 2
    assert positions.start("q") == (0, 1)
    positions.claimed("q", (0, 1), rows((0, 3), (0, 4)), limit=2, seconds=0.001)
    clock.now += FRONT_SCAN_EVERY / 2
    assert positions.start("q") is None  # a second since the last claim from the front
    positions.claimed("q", None, rows((-1, 90), (0, 5)), limit=2, seconds=0.001)
    assert positions.start("q") == (-1, 90)


def test_rows_sorting_before_the_claim_position_are_delivered_within_a_second_of_a_backlog(
    engine, ob, maker, monkeypatch
):
    # Claims from the front come every FRONT_SCAN_EVERY here. Spacing them by their own cost (for a
    # held transaction, tested in test_claim_position_listening.py) let one scan slowed by a loaded
    # host put the next one up to FRONT_SCAN_MAX away, past this test's count of deliveries.
    monkeypatch.setattr("outbox.relay.claim_position._FRONT_SCAN_SPACING", 0.0)
    delivered: list[str] = []
    lock = threading.Lock()
    failed_once: set[int] = set()

    @ob.handler("work", name="work", max_attempts=3)
    def work(msg):
        time.sleep(HANDLER_SECONDS)
        if msg.payload.get("retry") and msg.attempt == 1:
            failed_once.add(msg.id)
            raise RetryLater("not yet", delay=0.0)
        with lock:
            delivered.append(msg.payload["name"])

    late: Session | None = None
    if engine.dialect.name == "postgresql":
        # Takes its id now, before the whole backlog, and commits once the relay is well past it.
        # (SQLite writers take turns: a later transaction cannot commit in between.)
        Base.metadata.create_all(engine)
        late = maker()
        late.begin()
        emit(late, "work", {"name": "late commit"})
        late.add(Invoice(number="1"))
        late.flush()  # writes the event too, as any flush of an emitting session does
    with maker() as s, s.begin():
        emit(s, "work", {"name": "retried", "retry": True})
        for n in range(BACKLOG):
            emit(s, "work", {"name": f"backlog {n}"})

    relay = Relay(ob, engine, concurrency=CONCURRENCY, batch_size=CONCURRENCY)
    outcome: list[Any] = []
    drain = threading.Thread(target=lambda: outcome.append(relay.run_until_idle()))
    drain.start()
    try:
        wait_until(lambda: len(delivered) >= 50, "the relay to be well into the backlog", timeout=30)
        with maker() as s, s.begin():
            emit(s, "work", {"name": "urgent"}, priority=-1)
        became_claimable = {"urgent": len(delivered)}
        if late is not None:
            late.commit()
            became_claimable["late commit"] = len(delivered)
    finally:
        if late is not None:
            late.close()
        drain.join(timeout=60)
    assert not drain.is_alive()

    assert outcome[0].delivered == len(delivered) == BACKLOG + 1 + len(became_claimable)
    assert sorted(delivered) == sorted(set(delivered))
    assert failed_once, "the retried message never failed its first attempt"
    became_claimable["retried"] = 0  # due at once: it failed in the first claims
    for name, before in became_claimable.items():
        waited = delivered.index(name) - before
        assert waited <= WITHIN, f"{name!r} waited {waited} deliveries behind the claim position"
    # And it did not wait for the backlog to end. (How soon is the bound above: a fixed share of
    # the backlog would be a second, tighter and flaky, bound.)
    after_urgent = len(delivered) - 1 - delivered.index("urgent")
    assert after_urgent >= BACKLOG // 10, f"only {after_urgent} deliveries came after 'urgent'"
    with engine.connect() as conn:
        assert set(conn.execute(select(m.c.status)).scalars()) == {"delivered"}
        if late is not None:
            ids = {name: id_ for name, id_ in conn.execute(select(m.c.payload["name"].as_string(), m.c.id))}
            assert ids["late commit"] < ids["backlog 0"], "the late commit's row did not take its id early"


def test_a_claim_that_fails_after_a_short_claim_from_the_position_leaves_that_claims_rows_delivering(
    pg_engine: Engine, ob: outbox.Outbox, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The position's claim came back short, then the claim from the front fails: a real fault in between.

    The relay's claim connection is terminated by the server between the two
    statements of one round. The first statement's rows were started before
    the second was sent, so they are delivered on their first attempt, not
    held until their leases (60 s here) run out.
    """
    # The position is used for the second claim, however long the first handlers take on a busy host.
    monkeypatch.setattr("outbox.relay.claim_position.FRONT_SCAN_EVERY", 3600.0)
    gate: dict[str, Any] = {}
    started: list[int] = []

    @ob.handler("work", name="work")
    async def work(msg):
        if "open" not in gate:
            gate["loop"], gate["open"] = asyncio.get_running_loop(), asyncio.Event()
        started.append(msg.payload["n"])
        await gate["open"].wait()

    terminated: list[bool] = []

    def cut_the_claim_connection(sender: Any, relay: Any, messages: list[Any]) -> None:
        if len(messages) != 5 or terminated:  # only after the short claim from the position
            return
        with pg_engine.begin() as conn:
            terminated.extend(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND application_name = 'outbox-relay claim'"
                    )
                ).scalars()
            )

    maker = sessionmaker(pg_engine)
    ob.install(maker)
    with maker() as s, s.begin():
        for n in range(15):
            emit(s, "work", {"n": n})
    # A relay that does not listen follows a short claim from its position with one from the front.
    relay = Relay(ob, pg_engine, concurrency=10, batch_size=10, poll_interval=0.05, lease=60.0, listen=False)
    signals.message_claimed.connect(cut_the_claim_connection, sender=ob)
    serving = threading.Thread(target=relay.run)
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    serving.start()
    try:
        # The first claim, from the front, fills every slot; its handlers wait for the gate.
        wait_until(lambda: len(started) == 10, "the first claim's 10 handlers to start")
        gate["loop"].call_soon_threadsafe(gate["open"].set)  # all 10 slots free at once
        # Next: 5 rows from the position (short), then the claim from the front, which fails.

        def all_delivered() -> bool:
            with pg_engine.connect() as conn:
                return set(conn.execute(select(m.c.status)).scalars()) == {"delivered"}

        wait_until(all_delivered, "every message to be delivered, well before a lease could expire")
    finally:
        relay.stop()
        serving.join(30)
        signals.message_claimed.disconnect(cut_the_claim_connection, sender=ob)
        ob.uninstall(maker)
    assert not serving.is_alive()

    assert terminated == [True], "the claim connection was not cut between the two claims"
    assert [r.getMessage() for r in caplog.records if getattr(r, "action", None) == "db_error"]
    assert sorted(started) == list(range(15))
    with pg_engine.connect() as conn:
        assert set(conn.execute(select(m.c.status, m.c.attempts))) == {("delivered", 1)}
        assert sorted(conn.execute(select(a.c.message_id, a.c.attempt, a.c.outcome))) == [
            (id_, 1, "delivered") for id_ in sorted(conn.execute(select(m.c.id)).scalars())
        ]
