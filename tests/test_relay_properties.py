"""Properties of the relay, checked by hypothesis against real databases.

Each example opens its own state (STYLE.md, pitfall 8): one database per test,
and every example works only on rows above the id watermark it read at its
start, with group keys of its own, so earlier examples cannot leak into it.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Backoff, Outbox, RetryLater, emit
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt
_examples = itertools.count()


@settings(max_examples=500, deadline=None)
@given(
    base=st.floats(min_value=1e-3, max_value=60, allow_nan=False),
    spread=st.floats(min_value=1, max_value=1e4, allow_nan=False),
    attempt=st.integers(min_value=1, max_value=5000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_stays_within_its_bounds(base, spread, attempt, seed):
    backoff = Backoff(base=base, cap=base * spread)
    ceiling = backoff.ceiling(attempt)
    assert ceiling <= backoff.cap
    if attempt <= 64:  # beyond that the exponential has long passed any cap
        assert ceiling == pytest.approx(min(backoff.cap, base * 2.0 ** (attempt - 1)))
    else:
        assert ceiling == backoff.cap
    assert ceiling >= backoff.ceiling(max(attempt - 1, 1))  # never shrinks as attempts grow
    delay = backoff.delay(attempt, random.Random(seed))
    assert 0.0 <= delay <= ceiling and math.isfinite(delay)


def emit_work(ob: Outbox, engine: Engine, count: int) -> None:
    """Commit ``count`` "work" events, payloads numbered from 0."""
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory() as s, s.begin():
            for n in range(count):
                emit(s, "work", {"n": n})
    finally:
        ob.uninstall(factory)


def _watermark(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.max(m.c.id), 0))).scalar_one())


def _drain_until_settled(relay_factory: Any, engine: Engine, start: int, rounds: int = 200) -> None:
    """Drain repeatedly: retries with a backoff wait are due moments later."""
    for _ in range(rounds):
        relay_factory().run_until_idle()
        with engine.connect() as conn:
            left = conn.execute(
                select(func.count()).where(m.c.id > start, m.c.status.in_(("pending", "running")))
            ).scalar_one()
        if not left:
            return
        time.sleep(0.003)
    raise AssertionError("messages still pending after many drains")


group_plans = st.lists(
    st.tuples(
        st.sampled_from("abc"), st.integers(min_value=0, max_value=3)
    ),  # (group, failures before success)
    min_size=1,
    max_size=12,
)


@pytest.mark.parametrize("policy", ["block", "skip"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=group_plans, concurrency=st.integers(min_value=1, max_value=6), batch=st.integers(1, 6))
def test_groups_are_delivered_in_emit_order_under_random_failures(engine, policy, plan, concurrency, batch):
    example = next(_examples)
    start = _watermark(engine)
    failures_left = {i: fails for i, (_, fails) in enumerate(plan)}
    delivered: list[tuple[str, int]] = []
    running: set[str] = set()
    overlaps: list[str] = []

    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))

    @ob.handler("step", name=f"ordered_{example}", max_attempts=10)
    def ordered(msg):
        group, index = msg.group_key, msg.payload["i"]
        if group in running:
            overlaps.append(group)
        running.add(group)
        try:
            if failures_left[index] > 0:
                failures_left[index] -= 1
                raise RetryLater("flaky", delay=0)
            delivered.append((group, index))
        finally:
            running.discard(group)

    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        # Emitted across several transactions: id order is emit order.
        for first in range(0, len(plan), 4):
            with factory() as s, s.begin():
                for position in range(first, min(first + 4, len(plan))):
                    group = plan[position][0]
                    emit(s, "step", {"i": position}, group_key=f"{example}-{group}")
    finally:
        ob.uninstall(factory)

    _drain_until_settled(
        lambda: Relay(ob, engine, concurrency=concurrency, batch_size=batch, group_policy=policy),
        engine,
        start,
    )
    assert not overlaps, "two messages of one group ran at the same time"
    by_group: dict[str, list[int]] = defaultdict(list)
    for group, index in delivered:
        by_group[group].append(index)
    for group in by_group:
        expected = [i for i, (g, _) in enumerate(plan) if f"{example}-{g}" == group]
        assert by_group[group] == expected, f"group {group} out of order"
    assert len(delivered) == len(plan)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(min_value=1, max_value=15),
    crashes=st.lists(st.integers(min_value=1, max_value=8), max_size=3),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_every_message_is_delivered_at_least_once_despite_crashed_relays(engine, count, crashes, seed):
    """A "crash" claims a batch and never reports back; its leases must expire and be recovered."""
    example = next(_examples)
    start = _watermark(engine)
    seen: dict[int, int] = defaultdict(int)
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    name = f"effect_{example}"

    @ob.handler("work", name=name, max_attempts=10)
    def effect(msg):
        seen[msg.payload["n"]] += 1

    emit_work(ob, engine, count)

    rng = random.Random(seed)
    abandoned = 0
    for i, size in enumerate(crashes):
        crashed = Relay(ob, engine, relay_id=f"crashed-{example}-{i}", lease=0.02)
        abandoned += len(crashed.store.claim("default", [name], size))
        if rng.random() < 0.5:  # sometimes a healthy relay runs between crashes
            Relay(ob, engine).run_until_idle()
    time.sleep(0.03)  # every abandoned lease is now expired
    _drain_until_settled(lambda: Relay(ob, engine), engine, start)

    assert sorted(seen) == list(range(count)), "a message was lost"
    with engine.connect() as conn:
        statuses = set(conn.execute(select(m.c.status).where(m.c.id > start)).scalars())
        recovered = conn.execute(
            select(func.count()).where(a.c.message_id > start, a.c.outcome == "lease_expired")
        ).scalar_one()
    assert statuses == {"delivered"}
    assert recovered == abandoned


# A relay that dies between its handlers' side effects and the write of their outcomes: the database
# refuses that write (and only that write), as if the process had been killed at that moment. Lease
# recoveries, which name the dead relay, still go through.
CRASHING = "crash-after-effect-"
_REFUSE_OUTCOMES = {
    "postgresql": [
        """
        CREATE FUNCTION refuse_outcomes() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'relay % crashed before recording its outcomes', NEW.relay_id;
        END $$
        """,
        f"""
        CREATE TRIGGER refuse_outcomes BEFORE INSERT ON outbox_attempt FOR EACH ROW
            WHEN (NEW.relay_id LIKE '{CRASHING}%' AND NEW.outcome <> 'lease_expired')
            EXECUTE FUNCTION refuse_outcomes()
        """,
    ],
    "sqlite": [
        f"""
        CREATE TRIGGER refuse_outcomes BEFORE INSERT ON outbox_attempt
        WHEN NEW.relay_id LIKE '{CRASHING}%' AND NEW.outcome <> 'lease_expired'
        BEGIN SELECT RAISE(ABORT, 'relay crashed before recording its outcomes'); END
        """
    ],
}


@pytest.fixture
def crash_before_recording(engine: Engine) -> Engine:
    """Once per test (its database serves every example): relays named ``crash-after-effect-*`` die."""
    with engine.begin() as conn:
        for statement in _REFUSE_OUTCOMES[engine.dialect.name]:
            conn.execute(text(statement))
    return engine


def _leases_expired(engine: Engine, start: int) -> bool:
    with engine.connect() as conn:
        now = conn.execute(select(func.now())).scalar_one() if engine.dialect.name == "postgresql" else None
        held = conn.execute(select(m.c.locked_until).where(m.c.id > start, m.c.status == "running")).scalars()
        return all(until < (now or datetime.now(UTC)) for until in held)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(min_value=1, max_value=12),
    crashes=st.lists(
        st.tuples(st.integers(min_value=1, max_value=6), st.sampled_from(["after_effect", "after_claim"])),
        max_size=4,
    ),
    seed=st.integers(min_value=0, max_value=1000),
)
@example(count=5, crashes=[(3, "after_effect"), (2, "after_effect")], seed=0)
def test_every_effect_happens_at_least_once_when_relays_crash_before_recording_it(
    crash_before_recording, count, crashes, seed
):
    """Crashes after the handler's side effect, before its outcome is stored, mixed with crashes right
    after a claim: every message ends delivered, its effect happened at least once, and every run
    whose outcome was lost is on record as a lease recovery naming the relay that died."""
    engine = crash_before_recording
    example = next(_examples)
    start = _watermark(engine)
    effects: dict[int, list[str]] = defaultdict(list)  # message number -> who ran it
    running_as = ["healthy"]
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    name = f"side_effect_{example}"

    @ob.handler("work", name=name, max_attempts=20)
    async def effect(msg):
        effects[msg.payload["n"]].append(running_as[0])

    emit_work(ob, engine, count)

    rng = random.Random(seed)
    for i, (size, kind) in enumerate(crashes):
        if kind == "after_claim":
            Relay(ob, engine, relay_id=f"claimed-{example}-{i}", lease=0.02).store.claim(
                "default", [name], size
            )
        else:
            running_as[0] = f"{CRASHING}{example}-{i}"
            dying = Relay(ob, engine, relay_id=running_as[0], lease=0.02, concurrency=size, batch_size=size)
            try:
                dying.run_until_idle()
            except SQLAlchemyError as exc:
                assert "crashed before recording" in str(exc)
            running_as[0] = "healthy"
        if rng.random() < 0.5:  # sometimes a healthy relay runs between crashes
            Relay(ob, engine).run_until_idle()
    deadline = time.monotonic() + 10
    while not _leases_expired(engine, start):  # evidence that the dead relays' claims can be taken back
        assert time.monotonic() < deadline, "leases of 0.02 s never expired"
        time.sleep(0.005)
    _drain_until_settled(lambda: Relay(ob, engine), engine, start)

    assert sorted(effects) == list(range(count)), "a message's effect never happened"
    assert all(runs.count("healthy") == 1 for runs in effects.values()), effects
    with engine.connect() as conn:
        statuses = set(conn.execute(select(m.c.status).where(m.c.id > start)).scalars())
        numbers = dict(conn.execute(select(m.c.id, m.c.payload).where(m.c.id > start)).all())
        recovered = {
            (numbers[h.message_id]["n"], h.relay_id)
            for h in conn.execute(select(a).where(a.c.message_id > start, a.c.outcome == "lease_expired"))
        }
        recorded_by_the_dead = conn.execute(
            select(func.count()).where(a.c.relay_id.like(f"{CRASHING}%"), a.c.outcome != "lease_expired")
        ).scalar_one()
    assert statuses == {"delivered"}
    assert recorded_by_the_dead == 0, "a relay that crashed before recording recorded something"
    lost = {(n, who) for n, runs in effects.items() for who in runs if who != "healthy"}
    if crashes and crashes[0][1] == "after_effect":  # the control: everything was due, so it ran some
        assert any(who == f"{CRASHING}{example}-0" for _, who in lost), "the first crash ran no handler"
    assert lost <= recovered, "a run whose outcome was lost left no lease_expired row"
