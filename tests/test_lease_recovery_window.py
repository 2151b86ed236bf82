"""Lease recovery reads the leases that ran out since its last look, and still takes back every one.

While a transaction holds back the xmin horizon, the lease index keeps an
entry for every row that was ever running; a look for every lease that ran
out before now walks them all, every ten seconds, for as long as the hold
lasts. So a look reads from where the last one stopped (relay/recovery.py).
These tests hold it to what recovery promises: nothing a window steps over is
left running for good, on either database.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from relayproc import wait_until
from sqlalchemy import Engine, event, func, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import emit
from outbox.relay import Relay
from outbox.relay.recovery import FULL_LOOK_EVERY, Look, RecoveryWindow, recover_expired

m = outbox.outbox_message
LEASE = 0.05


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_look_is_full_then_each_starts_where_the_last_stopped_with_a_full_one_spaced_by_cost():
    clock = Clock()
    window = RecoveryWindow(clock)
    t0 = datetime(2026, 1, 1)
    assert window.since() is None  # nothing known: every lease that ran out
    window.looked(None, Look([], t0), seconds=0.001)
    assert window.since() == t0
    window.looked(t0, Look([], t0 + timedelta(seconds=10)), seconds=0.001)
    assert window.since() == t0 + timedelta(seconds=10)
    clock.now += FULL_LOOK_EVERY
    assert window.since() is None  # a full look again, for what no window could see
    window.looked(None, Look([], t0 + timedelta(seconds=70)), seconds=FULL_LOOK_EVERY)  # a costly one
    clock.now += FULL_LOOK_EVERY
    assert window.since() == t0 + timedelta(seconds=70)  # spaced a hundred times its cost
    clock.now += 99 * FULL_LOOK_EVERY
    assert window.since() is None


@pytest.fixture
def relay_ob() -> outbox.Outbox:
    ob = outbox.Outbox()
    ob.route("e", lambda msg: None, name="r")
    return ob


def _emit(engine: Engine, ob: outbox.Outbox, count: int) -> None:
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker() as s, s.begin():
            for n in range(count):
                emit(s, "e", {"n": n})
    finally:
        ob.uninstall(maker)


def _claimed_and_lapsed(engine: Engine, ob: outbox.Outbox, count: int) -> dict[int, datetime]:
    """``count`` new messages claimed by a relay that then stops renewing; once every lease ran out,
    their leases by id."""
    _emit(engine, ob, count)
    crashed = Relay(ob, engine, relay_id="crashed", lease=LEASE)
    rows = crashed.store.claim("default", ["r"], count)
    assert len(rows) == count
    leases = _leases(engine, [r.id for r in rows])
    wait_until(lambda: _now(engine) > max(leases.values()), "the leases to run out", timeout=10)
    return leases


def _leases(engine: Engine, ids: list[int]) -> dict[int, datetime]:
    with engine.connect() as conn:
        rows = conn.execute(select(m.c.id, m.c.locked_until).where(m.c.id.in_(ids)))
        return {row.id: row.locked_until for row in rows}


def _now(engine: Engine) -> datetime:
    if engine.dialect.name == "sqlite":
        return datetime.now().astimezone()
    with engine.connect() as conn:
        return conn.execute(select(func.now())).scalar_one()


def _ids(look: Look) -> list[int]:
    return sorted(item.row.id for item in look.recovered)


def test_a_look_from_the_window_takes_the_leases_that_ran_out_since_and_not_those_before_it(engine, relay_ob):
    rescuer = Relay(relay_ob, engine, relay_id="rescuer").store
    first = _claimed_and_lapsed(engine, relay_ob, 3)
    full = recover_expired(rescuer, {}, random.Random(1))
    assert _ids(full) == sorted(first)
    assert full.resume_from > max(first.values())  # the read's now: every lease it could see

    later = _claimed_and_lapsed(engine, relay_ob, 2)
    windowed = recover_expired(rescuer, {}, random.Random(1), since=full.resume_from)
    assert _ids(windowed) == sorted(later)
    assert windowed.resume_from > max(later.values())

    # A lease written below the window (a claim that outlasted its own lease, a clock set back):
    # no look from the window reads it; the next full look takes it.
    (below,) = _claimed_and_lapsed(engine, relay_ob, 1)
    with engine.begin() as conn:
        conn.execute(update(m).where(m.c.id == below).values(locked_until=full.resume_from - timedelta(1)))
    assert recover_expired(rescuer, {}, random.Random(1), since=windowed.resume_from).recovered == []
    assert _ids(recover_expired(rescuer, {}, random.Random(1))) == [below]
    with engine.connect() as conn:
        assert set(conn.execute(select(m.c.status)).scalars()) == {"pending"}


def test_a_look_that_reads_its_limit_resumes_at_the_last_lease_it_read(engine, relay_ob):
    rescuer = Relay(relay_ob, engine, relay_id="rescuer").store
    lapsed = _claimed_and_lapsed(engine, relay_ob, 3)
    by_lease = sorted(lapsed, key=lapsed.__getitem__)
    first = recover_expired(rescuer, {}, random.Random(1), limit=2)
    assert _ids(first) == sorted(by_lease[:2])
    assert first.resume_from == lapsed[by_lease[1]]
    rest = recover_expired(rescuer, {}, random.Random(1), since=first.resume_from, limit=2)
    assert _ids(rest) == by_lease[2:]


@pytest.mark.postgres
def test_a_lease_another_relay_was_recovering_holds_the_window_back_until_it_is_taken(pg_engine, relay_ob):
    rescuer = Relay(relay_ob, pg_engine, relay_id="rescuer").store
    start = recover_expired(rescuer, {}, random.Random(1))
    lapsed = _claimed_and_lapsed(pg_engine, relay_ob, 2)
    held, free = sorted(lapsed)
    with pg_engine.connect() as other:  # another relay's recovery, still in its transaction
        other.execute(select(m.c.id).where(m.c.id == held).with_for_update())
        look = recover_expired(rescuer, {}, random.Random(1), since=start.resume_from)
        other.rollback()  # ... which failed: the lease is still expired and still running
    assert _ids(look) == [free]
    assert look.resume_from == lapsed[held]
    again = recover_expired(rescuer, {}, random.Random(1), since=look.resume_from)
    assert _ids(again) == [held]


# -- under a held horizon ----------------------------------------------------------------------

#: Rows run and finished while the horizon is held: each leaves a lease entry nothing may remove.
FINISHED_UNDER_HOLD = 5000

_RAN = """
INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,
                            status, attempts, max_attempts, locked_by, locked_until,
                            available_at, created_at, updated_at)
SELECT gen_random_uuid(), 'e', 'r', 'default', 0, '{}', '{}', 'running', 1, 5,
       'gone', now() - interval '1 minute', now(), now(), now()
  FROM generate_series(1, %(count)s)
"""
_FINISHED = "UPDATE outbox_message SET status = 'delivered', locked_by = NULL, locked_until = NULL"


@pytest.fixture
def held_horizon(pg_url: str) -> Iterator[None]:
    """A transaction idle with an xid for the test's length: the old versions stay."""
    holder = psycopg.connect(
        make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    )
    holder.execute("SELECT txid_current()")
    try:
        yield
    finally:
        holder.close()


def _buffers_read(engine: Engine, look: Any) -> int:
    """Buffers the look's read of ``outbox_message`` took, by its own statement under EXPLAIN."""
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "locked_until <" in statement:
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        look()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    ((statement, parameters),) = seen
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, parameters
        ).scalar()
    top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    assert "ix_outbox_message_lease" in json.dumps(top), top
    return int(top["Shared Hit Blocks"]) + int(top.get("Shared Read Blocks", 0))


@pytest.mark.postgres
def test_under_a_held_horizon_a_look_from_the_window_reads_none_of_the_leases_behind_it(
    pg_url, pg_engine, relay_ob, held_horizon
):
    rescuer = Relay(relay_ob, pg_engine, relay_id="rescuer").store
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(_RAN, {"count": FINISHED_UNDER_HOLD})
    with pg_engine.begin() as conn:
        conn.exec_driver_sql(_FINISHED)
    full: list[Look] = []
    whole = _buffers_read(pg_engine, lambda: full.append(recover_expired(rescuer, {}, random.Random(1))))
    time.sleep(0.01)
    since = full[0].resume_from
    windowed = _buffers_read(pg_engine, lambda: recover_expired(rescuer, {}, random.Random(1), since=since))
    assert full[0].recovered == []
    # Each entry the full look steps over points at a delivered row's dead version (a heap visit);
    # the window starts after all of them.
    assert whole >= FINISHED_UNDER_HOLD // 100, whole
    assert windowed <= 5, (windowed, whole)
    _claimed_and_lapsed(pg_engine, relay_ob, 1)
    assert len(recover_expired(rescuer, {}, random.Random(1), since=since).recovered) == 1
