"""The relay in-process, on real SQLite and PostgreSQL: outcomes, history, ordering, shutdown, signals."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Outbox, PermanentError, RetryLater, emit, signals
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt

FAST = Backoff(base=0.001, cap=0.002)


@pytest.fixture
def ob() -> Outbox:
    return Outbox(default_backoff=FAST)


@pytest.fixture
def maker(engine: Engine, ob: Outbox) -> Iterator[sessionmaker[Session]]:
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def emit_many(
    maker: sessionmaker[Session], event_type: str, payloads: list[dict[str, Any]], **options: Any
) -> None:
    with maker() as s, s.begin():
        for payload in payloads:
            emit(s, event_type, payload, **options)


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {f"{r.handler}:{r.payload['n']}": r.status for r in conn.execute(select(m).order_by(m.c.id))}


def history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def test_delivers_each_route_and_records_every_attempt(engine, ob, maker):
    seen: list[tuple[str, int, int]] = []

    @ob.handler("order.paid", name="sync_route")
    def sync_handler(msg):
        seen.append(("sync", msg.payload["n"], msg.attempt))

    @ob.handler("order.paid", name="async_route")
    async def async_handler(msg):
        await asyncio.sleep(0)
        seen.append(("async", msg.payload["n"], msg.attempt))

    emit_many(maker, "order.paid", [{"n": i} for i in range(5)])
    result = Relay(ob, engine, relay_id="relay-a").run_until_idle()

    assert result.delivered == 10 and result.retried == 0 and result.dead == 0
    assert sorted(seen) == sorted([(kind, i, 1) for kind in ("sync", "async") for i in range(5)])
    with engine.connect() as conn:
        rows = list(conn.execute(select(m)))
    assert {r.status for r in rows} == {"delivered"}
    assert all(r.delivered_at is not None and r.locked_by is None and r.attempts == 1 for r in rows)
    attempts = history(engine)
    assert len(attempts) == 10
    assert {(h.outcome, h.relay_id, h.attempt) for h in attempts} == {("delivered", "relay-a", 1)}
    assert all(h.finished_at >= h.started_at and h.duration_ms >= 0 for h in attempts)


def test_failures_retry_with_backoff_then_go_dead_with_the_reason(engine, ob, maker):
    calls: dict[str, int] = {}

    @ob.handler("job", name="flaky", max_attempts=3)
    def flaky(msg):
        calls["flaky"] = calls.get("flaky", 0) + 1
        if msg.attempt < 3:
            raise ConnectionError(f"endpoint down (attempt {msg.attempt})")

    @ob.handler("job", name="asks_later", max_attempts=5)
    def asks_later(msg):
        calls["asks_later"] = calls.get("asks_later", 0) + 1
        if msg.attempt == 1:
            raise RetryLater("rate limited", delay=0)

    @ob.handler("job", name="permanent", max_attempts=5)
    def permanent(msg):
        calls["permanent"] = calls.get("permanent", 0) + 1
        raise PermanentError("address rejected")

    @ob.handler("job", name="poison", max_attempts=2)
    def poison(msg):
        calls["poison"] = calls.get("poison", 0) + 1
        raise ValueError("cannot parse")

    emit_many(maker, "job", [{"n": 1}])
    Relay(ob, engine).run_until_idle()
    # Backoff waits are tiny but real: drain again until nothing is left pending.
    for _ in range(50):
        if "pending" not in statuses(engine).values():
            break
        time.sleep(0.01)
        Relay(ob, engine).run_until_idle()

    assert statuses(engine) == {
        "flaky:1": "delivered",
        "asks_later:1": "delivered",
        "permanent:1": "dead",
        "poison:1": "dead",
    }
    assert calls == {"flaky": 3, "asks_later": 2, "permanent": 1, "poison": 2}
    outcomes: dict[str, list[str]] = {}
    with engine.connect() as conn:
        names = dict(conn.execute(select(m.c.id, m.c.handler)).all())
        dead = {r.handler: r for r in conn.execute(select(m).where(m.c.status == "dead"))}
    for h in history(engine):
        outcomes.setdefault(names[h.message_id], []).append(h.outcome)
    assert outcomes == {
        "flaky": ["failed", "failed", "delivered"],
        "asks_later": ["retry", "delivered"],
        "permanent": ["dead"],
        "poison": ["failed", "dead"],
    }
    assert dead["permanent"].last_error == "address rejected"
    assert dead["poison"].last_error == "cannot parse" and dead["poison"].attempts == 2
    failed = [h for h in history(engine) if h.outcome == "failed" and names[h.message_id] == "flaky"]
    assert failed[0].error_type == "ConnectionError" and "endpoint down" in failed[0].error


def test_handler_timeout_is_an_attempt_and_a_retry(engine, ob, maker):
    release = threading.Event()

    @ob.handler("slow", name="slow_async", timeout=0.1, max_attempts=1)
    async def slow_async(msg):
        await asyncio.sleep(5)

    @ob.handler("slow", name="slow_sync", timeout=0.1, max_attempts=2)
    def slow_sync(msg):
        if msg.attempt == 1:
            release.wait(5)

    emit_many(maker, "slow", [{"n": 1}])
    started = time.monotonic()
    Relay(ob, engine).run_until_idle()
    release.set()
    assert time.monotonic() - started < 4, "a hung handler must not hold the relay"
    with engine.connect() as conn:
        names = dict(conn.execute(select(m.c.id, m.c.handler)).all())
    got = [(names[h.message_id], h.outcome, h.error_type) for h in history(engine)]
    assert ("slow_async", "dead", "TimeoutError") in got
    assert ("slow_sync", "timeout", "TimeoutError") in got
    assert statuses(engine)["slow_async:1"] == "dead"


def test_secrets_never_reach_history(engine, ob, maker):
    class Secretive:
        def outbox_secrets(self):
            return ["hunter2-very-secret"]

        def __call__(self, msg):
            err = RuntimeError("login failed for password hunter2-very-secret")
            err.detail = {"password": "hunter2-very-secret", "code": 535}  # type: ignore[attr-defined]
            raise err

    ob.route("login", Secretive(), name="secretive", max_attempts=1)
    emit_many(maker, "login", [{"n": 1}])
    Relay(ob, engine).run_until_idle()
    with engine.connect() as conn:
        dumped = " ".join(str(tuple(r)) for r in conn.execute(select(a))) + " ".join(
            str(tuple(r)) for r in conn.execute(select(m))
        )
    assert "hunter2" not in dumped
    assert "***" in dumped and "535" in dumped


def test_priority_then_age_within_a_queue(engine, ob, maker):
    order: list[int] = []
    ob.route("p", lambda msg: order.append(msg.payload["n"]), name="record")
    with maker() as s, s.begin():
        emit(s, "p", {"n": 1}, priority=5)
        emit(s, "p", {"n": 2}, priority=0)
        emit(s, "p", {"n": 3}, priority=5)
        emit(s, "p", {"n": 4}, priority=-1)
    Relay(ob, engine, concurrency=1).run_until_idle()
    assert order == [4, 2, 1, 3]


def test_group_is_delivered_one_at_a_time_in_order_and_a_failing_head_holds_only_its_group(engine, ob, maker):
    log: list[tuple[str, int]] = []
    fail_once = {("a", 0)}

    @ob.handler("g", name="grouped", max_attempts=5)
    def grouped(msg):
        item = (msg.group_key, msg.payload["n"])
        if item in fail_once:
            fail_once.discard(item)
            raise RetryLater("not yet", delay=1.0)
        log.append(item)

    with maker() as s, s.begin():
        for n in range(4):
            emit(s, "g", {"n": n}, group_key="a")
            emit(s, "g", {"n": n}, group_key="b")
    Relay(ob, engine, concurrency=8).run_until_idle()
    # Group b flowed while a's head waited for its retry.
    assert [n for g, n in log if g == "b"] == [0, 1, 2, 3]
    assert [n for g, n in log if g == "a"] == []
    time.sleep(1.1)
    Relay(ob, engine, concurrency=8).run_until_idle()
    assert [n for g, n in log if g == "a"] == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["block", "skip"])
def test_group_behind_a_dead_message_follows_the_policy(engine, ob, maker, policy):
    delivered: list[int] = []

    @ob.handler("g", name="grouped", max_attempts=1)
    def grouped(msg):
        if msg.payload["n"] == 0:
            raise PermanentError("bad head")
        delivered.append(msg.payload["n"])

    emit_many(maker, "g", [{"n": n} for n in range(3)], group_key="only")
    Relay(ob, engine, group_policy=policy).run_until_idle()
    if policy == "block":
        assert delivered == []
        assert statuses(engine) == {"grouped:0": "dead", "grouped:1": "pending", "grouped:2": "pending"}
    else:
        assert delivered == [1, 2]


def test_rows_for_routes_this_relay_does_not_know_stay_pending(engine, ob, maker, caplog):
    ob.route("e", lambda msg: None, name="known")
    ob.route("e", lambda msg: None, name="only_in_new_deploy")
    emit_many(maker, "e", [{"n": 1}])
    old_deploy = Outbox()
    old_deploy.route("e", lambda msg: None, name="known")
    Relay(old_deploy, engine).run_until_idle()
    assert statuses(engine) == {"known:1": "delivered", "only_in_new_deploy:1": "pending"}


def test_messages_emitted_for_another_queue_are_claimed_by_an_all_queue_relay_only(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r", queue="mail")
    with maker() as s, s.begin():
        emit(s, "e", {"n": 1})
        emit(s, "e", {"n": 2}, queue="bulk")
    Relay(ob, engine, queues=["mail"]).run_until_idle()
    assert statuses(engine) == {"r:1": "delivered", "r:2": "pending"}
    Relay(ob, engine).run_until_idle()
    assert statuses(engine) == {"r:1": "delivered", "r:2": "delivered"}


def test_expired_lease_is_recovered_and_recorded(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}])
    crashed = Relay(ob, engine, relay_id="crashed", lease=0.05)
    rows = crashed.store.claim("default", ["r"], 10)  # claimed, then the relay "dies"
    assert len(rows) == 1 and statuses(engine) == {"r:1": "running"}
    time.sleep(0.1)
    result = Relay(ob, engine, relay_id="rescuer").run_until_idle()
    assert result.recovered == 1 and result.delivered == 1
    outcomes = [(h.outcome, h.relay_id, h.attempt) for h in history(engine)]
    assert outcomes == [("lease_expired", "crashed", 1), ("delivered", "rescuer", 2)]


def test_long_handler_keeps_its_lease(engine, ob, maker):
    @ob.handler("e", name="slow", timeout=5)
    async def slow(msg):
        await asyncio.sleep(0.6)

    emit_many(maker, "e", [{"n": 1}])
    relay = Relay(ob, engine, lease=0.3, relay_id="live")
    rival = Relay(ob, engine, lease=0.3, relay_id="rival")
    thread = threading.Thread(target=relay.run_until_idle)
    thread.start()
    time.sleep(0.45)  # past one lease length: only renewals keep the claim
    assert rival.store.recover_expired({}, __import__("random").Random()) == []
    thread.join()
    assert [(h.outcome, h.relay_id) for h in history(engine)] == [("delivered", "live")]


def test_stop_releases_unstarted_claims_without_counting_an_attempt(engine, ob, maker):
    started = threading.Event()

    @ob.handler("e", name="r", timeout=10)
    async def handler(msg):
        started.set()
        await asyncio.sleep(0.3)

    emit_many(maker, "e", [{"n": i} for i in range(3)])
    relay = Relay(ob, engine, concurrency=3, poll_interval=0.05, grace_period=5)
    original = relay._deliver

    async def slow_start(queue, row):  # only the first message starts before the stop
        if row.payload["n"] != 0:
            await asyncio.sleep(0.1)
        await original(queue, row)

    relay._deliver = slow_start  # type: ignore[method-assign]
    thread = threading.Thread(target=relay.run)
    thread.start()
    assert started.wait(5)
    relay.stop()
    thread.join(10)
    assert not thread.is_alive()
    with engine.connect() as conn:
        rows = {r.payload["n"]: r for r in conn.execute(select(m))}
    assert rows[0].status == "delivered"
    assert {(rows[n].status, rows[n].attempts, rows[n].locked_by) for n in (1, 2)} == {("pending", 0, None)}
    assert [h.message_id for h in history(engine)] == [rows[0].id]


def test_signals_report_claims_deliveries_retries_and_deaths(engine, ob, maker):
    @ob.handler("e", name="r", max_attempts=2)
    def handler(msg):
        if msg.payload["n"] == 1:
            raise RuntimeError("always")

    got: list[tuple[str, Any]] = []
    receivers = {
        "claimed": lambda sender, **kw: got.append(("claimed", len(kw["messages"]))),
        "delivered": lambda sender, **kw: got.append(("delivered", kw["message"].payload["n"])),
        "retry": lambda sender, **kw: got.append(("retry", kw["outcome"])),
        "dead": lambda sender, **kw: got.append(("dead", kw["error"])),
    }
    signals.message_claimed.connect(receivers["claimed"], sender=ob)
    signals.message_delivered.connect(receivers["delivered"], sender=ob)
    signals.retry_scheduled.connect(receivers["retry"], sender=ob)
    signals.message_dead.connect(receivers["dead"], sender=ob)
    try:
        emit_many(maker, "e", [{"n": 0}, {"n": 1}])
        Relay(ob, engine).run_until_idle()
        for _ in range(50):
            if "pending" not in statuses(engine).values():
                break
            time.sleep(0.01)
            Relay(ob, engine).run_until_idle()
    finally:
        for name, signal in (
            ("claimed", signals.message_claimed),
            ("delivered", signals.message_delivered),
            ("retry", signals.retry_scheduled),
            ("dead", signals.message_dead),
        ):
            signal.disconnect(receivers[name], sender=ob)
    assert ("delivered", 0) in got and ("retry", "failed") in got and ("dead", "always") in got
    assert sum(n for kind, n in got if kind == "claimed") == 3


def test_embedded_relay_wakes_on_its_own_commits_without_waiting_for_the_poll(engine, ob, maker):
    done = threading.Event()
    ob.route("e", lambda msg: done.set(), name="r")
    relay = Relay(ob, engine, poll_interval=30, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        time.sleep(0.3)  # the relay has made its first (empty) claim and sleeps for 30 s
        emit_many(maker, "e", [{"n": 1}])
        assert done.wait(10), "the commit signal should wake the relay long before its 30 s poll"
    finally:
        relay.stop()
        thread.join(10)


def test_bad_relay_configuration_fails_at_construction(engine, ob):
    with pytest.raises(ConfigurationError, match="no routes"):
        Relay(ob, engine)
    ob.route("e", lambda msg: None, name="r")
    for kwargs, match in [
        ({"concurrency": 0}, "concurrency"),
        ({"poll_interval": -1}, "poll_interval"),
        ({"lease": float("nan")}, "lease"),
        ({"group_policy": "maybe"}, "group_policy"),
        ({"queues": []}, "queues"),
        ({"queues": ["has space"]}, "queue"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            Relay(ob, engine, **kwargs)


def test_claim_query_uses_the_claim_index(pg_engine, ob):
    engine = pg_engine
    ob.route("e", lambda msg: None, name="r")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload,"
                " headers, status, attempts, max_attempts, available_at, created_at, updated_at)"
                " SELECT gen_random_uuid(), 'e', 'r', 'q' || (i % 5), 0, '{}', '{}',"
                " CASE WHEN i % 50 = 0 THEN 'pending' ELSE 'delivered' END, 1, 3, now(), now(), now()"
                " FROM generate_series(1, 20000) AS i"
            )
        )
        conn.execute(text("ANALYZE outbox_message"))
    relay = Relay(ob, engine, queues=["q1"])
    captured: list[str] = []
    from sqlalchemy import event

    @event.listens_for(engine, "before_cursor_execute", retval=True)
    def explain(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().startswith("UPDATE outbox_message") and "SKIP LOCKED" in statement:
            cursor.execute("EXPLAIN " + statement, parameters)
            captured.extend(row[0] for row in cursor.fetchall())
        return statement, parameters

    try:
        relay.store.claim("q1", ["r"], 10)
    finally:
        event.remove(engine, "before_cursor_execute", explain)
    plan = "\n".join(captured)
    assert "ix_outbox_message_claim" in plan, plan
    assert "Seq Scan on outbox_message" not in plan.replace("Seq Scan on outbox_message earlier", ""), plan


def test_pending_count_helper(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}, {"n": 2}])
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(m).where(m.c.status == "pending")).scalar() == 2
