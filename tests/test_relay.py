"""The relay in-process, on real SQLite and PostgreSQL: outcomes, history, ordering, shutdown, signals."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from relayproc import wait_until
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from bench.harness import function_plans
from outbox import ConfigurationError, Outbox, PermanentError, RetryLater, emit, signals
from outbox.relay import Relay
from outbox.relay.claimer import Claimer
from outbox.relay.recovery import recover_expired
from outbox.relay.sql_postgresql import CLAIM

m = outbox.outbox_message
a = outbox.outbox_attempt


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


def clock(engine: Engine) -> datetime:
    """ "Now" as the relay sees it: the server's clock on PostgreSQL, this host's UTC clock on SQLite."""
    if engine.dialect.name != "postgresql":
        return datetime.now(UTC)
    with engine.connect() as conn:
        return conn.execute(select(func.now())).scalar_one()


def leases(engine: Engine) -> list[datetime]:
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.locked_until).where(m.c.status == "running")).scalars())


def all_leases_expired(engine: Engine) -> bool:
    held = leases(engine)
    return bool(held) and max(held) < clock(engine)


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


def test_a_handler_gets_the_payload_and_headers_as_emitted(engine, ob, maker):
    """Non-ASCII text, nesting and numbers survive the round trip; no headers arrive as an empty dict."""
    seen: dict[int, tuple[Any, dict[str, str]]] = {}

    @ob.handler("note", name="keep")
    async def keep(msg):
        seen[msg.payload["n"]] = (msg.payload, msg.headers)

    payload = {"n": 1, "text": "Zoë paid 12 € — 東京 ✓", "items": [{"q": 2, "price": 9.99}], "none": None}
    with maker() as s, s.begin():
        emit(s, "note", payload, headers={"x-tenant": "t1", "x-note": "ünïcode"})
        emit(s, "note", {"n": 2})
    Relay(ob, engine).run_until_idle()
    assert seen[1] == (payload, {"x-tenant": "t1", "x-note": "ünïcode"})
    assert seen[2] == ({"n": 2}, {})
    assert type(seen[2][1]) is dict


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
    emit_many(maker, "e", [{"n": 2}])
    old_deploy = Outbox()
    old_deploy.route("e", lambda msg: None, name="known")
    caplog.set_level(logging.WARNING, logger="outbox.relay")
    Relay(old_deploy, engine).run_until_idle()
    assert statuses(engine) == {
        "known:1": "delivered",
        "only_in_new_deploy:1": "pending",
        "known:2": "delivered",
        "only_in_new_deploy:2": "pending",
    }
    unknown = [r for r in caplog.records if getattr(r, "action", None) == "unknown_handler"]
    assert [(r.levelname, r.handler, r.count) for r in unknown] == [("WARNING", "only_in_new_deploy", 2)]
    assert "'only_in_new_deploy'" in unknown[0].getMessage() and "2 pending" in unknown[0].getMessage()


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
    started = threading.Event()
    finish = threading.Event()

    @ob.handler("e", name="slow", timeout=30)
    def slow(msg):
        started.set()
        finish.wait(20)  # held by the test until it has seen the first lease lapse

    emit_many(maker, "e", [{"n": 1}])
    relay = Relay(ob, engine, lease=1, relay_id="live")
    rival = Relay(ob, engine, lease=1, relay_id="rival")
    thread = threading.Thread(target=relay.run_until_idle)
    thread.start()
    try:
        assert started.wait(10), "the handler never started"
        (first,) = leases(engine)
        wait_until(lambda: clock(engine) > first, "the first lease to run out")
        # Past one lease length, the handler still running: only renewals keep the claim.
        assert recover_expired(rival.store, {}, random.Random()).recovered == []
        (renewed,) = leases(engine)
        assert renewed > first and thread.is_alive()
    finally:
        finish.set()
        thread.join(10)
    assert [(h.outcome, h.relay_id) for h in history(engine)] == [("delivered", "live")]


def test_stop_releases_unstarted_claims_without_counting_an_attempt(engine, ob, maker, monkeypatch):
    started = threading.Event()

    @ob.handler("e", name="r", timeout=10)
    async def handler(msg):
        started.set()
        await asyncio.sleep(0.3)

    emit_many(maker, "e", [{"n": i} for i in range(3)])
    relay = Relay(ob, engine, concurrency=3, poll_interval=0.05, grace_period=5)
    original = Claimer._deliver

    async def slow_start(self, queue, row, *args):  # only the first message starts before the stop
        if row.payload["n"] != 0:
            await asyncio.sleep(0.1)
        await original(self, queue, row, *args)

    monkeypatch.setattr(Claimer, "_deliver", slow_start)
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


def test_a_forced_stop_on_the_last_attempt_makes_the_message_dead(engine, ob, maker):
    started: Counter[str] = Counter()

    async def hang(msg):
        started[msg.handler] += 1
        await asyncio.sleep(60)

    ob.route("e", hang, name="last_try", max_attempts=1)
    ob.route("e", hang, name="spare", max_attempts=2)  # the control: a cancelled attempt with one to spare
    emit_many(maker, "e", [{"n": 1}])
    relay = Relay(ob, engine, grace_period=60, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: started == Counter(last_try=1, spare=1), "both handlers to start")
    finally:
        relay.stop(graceful=False)
        thread.join(10)
    assert not thread.is_alive()

    assert statuses(engine) == {"last_try:1": "dead", "spare:1": "pending"}
    with engine.connect() as conn:
        names = dict(conn.execute(select(m.c.id, m.c.handler)).all())
        rows = {r.handler: r for r in conn.execute(select(m))}
    tried = {names[h.message_id]: (h.attempt, h.outcome, h.error_type) for h in history(engine)}
    assert tried == {"last_try": (1, "dead", "Cancelled"), "spare": (1, "failed", "Cancelled")}
    assert (rows["last_try"].attempts, rows["last_try"].locked_by) == (1, None)
    assert "may or may not have taken effect" in rows["last_try"].last_error


def test_stop_before_run_or_before_its_loop_is_up_still_stops_the_relay(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}])

    stopped_first = Relay(ob, engine, poll_interval=600, listen=False)
    stopped_first.stop()  # before run() at all
    thread = threading.Thread(target=stopped_first.run)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "a stop() that came before run() was lost: the relay serves on"
    assert statuses(engine) == {"r:1": "pending"}, "a relay stopped before it ran claims nothing"

    for _ in range(5):  # stop() as the thread starts: usually before the loop exists, sometimes after
        relay = Relay(ob, engine, poll_interval=600, listen=False)
        thread = threading.Thread(target=relay.run)
        thread.start()
        relay.stop()
        thread.join(20)
        assert not thread.is_alive(), "a stop() right after starting run() was lost"

    # The control: a relay nobody stops serves, and the early stops did not leak into it.
    serving = Relay(ob, engine, poll_interval=600, listen=False)
    thread = threading.Thread(target=serving.run)
    thread.start()
    try:
        wait_until(lambda: statuses(engine) == {"r:1": "delivered"}, "an unstopped relay to deliver")
        assert thread.is_alive()
    finally:
        serving.stop()
        thread.join(20)
    assert not thread.is_alive()


def test_relay_started_and_relay_stopped_are_sent_once_each_in_order(engine, ob):
    ob.route("e", lambda msg: None, name="r")
    got: list[tuple[str, Any]] = []
    up = threading.Event()

    def on_started(sender, relay):
        got.append(("started", relay))
        up.set()

    def on_stopped(sender, relay):
        got.append(("stopped", relay))

    signals.relay_started.connect(on_started, sender=ob)
    signals.relay_stopped.connect(on_stopped, sender=ob)
    try:
        relay = Relay(ob, engine, poll_interval=600, listen=False)
        thread = threading.Thread(target=relay.run)
        thread.start()
        try:
            assert up.wait(10), "relay_started never came"
            assert got == [("started", relay)]
        finally:
            relay.stop()
            thread.join(10)
    finally:
        signals.relay_started.disconnect(on_started, sender=ob)
        signals.relay_stopped.disconnect(on_stopped, sender=ob)
    assert got == [("started", relay), ("stopped", relay)]


def test_relay_stopped_is_sent_when_serving_fails_after_it_started(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}])
    got: list[str] = []

    def on_started(sender, relay):
        got.append("started")

    def on_stopped(sender, relay):
        got.append("stopped")

    def interrupt(sender, relay, messages):  # Ctrl-C while serving: receivers' own bugs are contained
        raise KeyboardInterrupt

    signals.relay_started.connect(on_started, sender=ob)
    signals.relay_stopped.connect(on_stopped, sender=ob)
    signals.message_claimed.connect(interrupt, sender=ob)
    try:
        with pytest.raises(KeyboardInterrupt):
            Relay(ob, engine, poll_interval=600, listen=False).run()
    finally:
        signals.relay_started.disconnect(on_started, sender=ob)
        signals.relay_stopped.disconnect(on_stopped, sender=ob)
        signals.message_claimed.disconnect(interrupt, sender=ob)
    assert got == ["started", "stopped"], "whoever saw the relay start must see it stop"


def test_lease_recovery_announces_a_retry_or_a_death(engine, ob, maker):
    ob.route("e", lambda msg: None, name="retries", max_attempts=3)
    ob.route("e", lambda msg: None, name="last_try", max_attempts=1)
    emit_many(maker, "e", [{"n": 1}])
    crashed = Relay(ob, engine, relay_id="crashed", lease=0.05)
    assert len(crashed.store.claim("default", ["last_try", "retries"], 10)) == 2  # then it "dies"
    wait_until(lambda: all_leases_expired(engine), "the crashed relay's leases to run out")

    retries: list[tuple[str, str, int, float, str]] = []
    deaths: list[tuple[str, int, str]] = []

    def on_retry(sender, relay, message, outcome, delay, error):
        retries.append((message.handler, outcome, message.attempt, delay, error))

    def on_dead(sender, relay, message, error):
        deaths.append((message.handler, message.attempt, error))

    signals.retry_scheduled.connect(on_retry, sender=ob)
    signals.message_dead.connect(on_dead, sender=ob)
    try:
        result = Relay(ob, engine, relay_id="rescuer").run_until_idle()
    finally:
        signals.retry_scheduled.disconnect(on_retry, sender=ob)
        signals.message_dead.disconnect(on_dead, sender=ob)

    assert result.recovered == 2
    [(handler, outcome, attempt, delay, error)] = [r for r in retries if r[1] == "lease_expired"]
    assert (handler, attempt) == ("retries", 1) and 0 <= delay <= ob.default_backoff.ceiling(1)
    assert "crashed" in error and "expired" in error
    [(handler, attempt, error)] = deaths
    assert (handler, attempt) == ("last_try", 1) and "crashed" in error and "expired" in error
    assert statuses(engine)["last_try:1"] == "dead"
    with engine.connect() as conn:
        names = dict(conn.execute(select(m.c.id, m.c.handler)).all())
    expired = [(names[h.message_id], h.relay_id) for h in history(engine) if h.outcome == "lease_expired"]
    assert sorted(expired) == [("last_try", "crashed"), ("retries", "crashed")]


def test_queue_concurrency_caps_one_queue_while_the_others_flow(engine, ob, maker):
    lock = threading.Lock()
    running: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    began: Counter[str] = Counter()
    go = threading.Event()

    @ob.handler("job", name="probe", timeout=30)
    def probe(msg):
        queue = msg.payload["queue"]
        with lock:
            running[queue] += 1
            began[queue] += 1
            peak[queue] = max(peak[queue], running[queue])
        try:
            go.wait(20)
        finally:
            with lock:
                running[queue] -= 1

    with maker() as s, s.begin():
        for n in range(6):
            emit(s, "job", {"queue": "bulk", "n": n}, queue="bulk")
        for n in range(6, 10):
            emit(s, "job", {"queue": "mail", "n": n}, queue="mail")
    relay = Relay(ob, engine, concurrency=10, queue_concurrency={"bulk": 2}, listen=False)
    thread = threading.Thread(target=relay.run_until_idle)
    thread.start()
    try:
        # Evidence first: all of mail and the capped two of bulk are running together.
        wait_until(lambda: began["mail"] == 4 and began["bulk"] >= 2, "mail and bulk deliveries to start")
    finally:
        go.set()
        thread.join(30)
    assert not thread.is_alive()
    assert set(statuses(engine).values()) == {"delivered"}
    assert began == Counter(bulk=6, mail=4)
    assert peak == Counter(bulk=2, mail=4), (
        "never more than 2 of bulk at once, while all of mail ran together"
    )


def drain_with_outcomes_in_one_batch(engine: Engine, ob: Outbox, **routes: Any) -> Any:
    """Each keyword names a route and what its handler does (return or raise) once all have begun.

    The handlers wait for each other, so every outcome is written in the same batch.
    """
    everyone_began = asyncio.Event()
    began: list[str] = []

    def route(name: str, finish: Any) -> None:
        async def handler(msg):
            began.append(name)
            if len(began) == len(routes):
                everyone_began.set()
            await everyone_began.wait()
            finish(msg)

        ob.route("e", handler, name=name)

    for name, finish in routes.items():
        route(name, finish)
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        emit_many(factory, "e", [{"n": 1}])
    finally:
        ob.uninstall(factory)
    return Relay(ob, engine).run_until_idle()


def raises(error: Exception) -> Any:
    def finish(msg):
        raise error

    return finish


def test_an_integer_retry_delay_is_recorded_alongside_other_outcomes(pg_engine, ob):
    result = drain_with_outcomes_in_one_batch(
        pg_engine,
        ob,
        asks_later=raises(RetryLater("rate limited", delay=30)),  # an int, as a Retry-After header gives it
        receipt=lambda msg: None,
    )
    assert (result.delivered, result.retried) == (1, 1)
    assert statuses(pg_engine) == {"asks_later:1": "pending", "receipt:1": "delivered"}


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
    delivered = {1: threading.Event(), 2: threading.Event()}
    ob.route("e", lambda msg: delivered[msg.payload["n"]].set(), name="r")
    emit_many(maker, "e", [{"n": 1}])  # found by the first claim round; after it the relay sleeps
    relay = Relay(ob, engine, poll_interval=600, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        assert delivered[1].wait(10), "the first claim round never delivered"
        emit_many(maker, "e", [{"n": 2}])
        assert delivered[2].wait(20), "the commit signal should wake the relay long before its 600 s poll"
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


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
    # The claim runs inside the database function outbox_claim: auto_explain reports its plan.
    raw = engine.raw_connection()
    try:
        nested = function_plans(
            raw.driver_connection, CLAIM, relay.store._claim_params("q1", ["r"], 10, None)
        )
        raw.rollback()
    finally:
        raw.close()
    plan = "\n".join(nested[0].lines)
    assert "ix_outbox_message_claim" in plan, plan
    assert "Seq Scan on outbox_message" not in plan.replace("Seq Scan on outbox_message earlier", ""), plan


def test_pending_count_helper(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}, {"n": 2}])
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(m).where(m.c.status == "pending")).scalar() == 2


def test_an_outcome_the_database_refuses_does_not_stall_the_others(pg_engine, ob):
    """One refused outcome is recorded without its text; the rest of its batch is recorded as usual."""
    with pg_engine.begin() as conn:
        conn.execute(
            text(
                """
                CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF NEW.error LIKE '%poison-outcome%' THEN
                        RAISE EXCEPTION 'refused' USING ERRCODE = 'data_exception';
                    END IF;
                    RETURN NEW;
                END $$;
                CREATE TRIGGER refuse_poison BEFORE INSERT ON outbox_attempt
                    FOR EACH ROW EXECUTE FUNCTION refuse_poison();
                """
            )
        )
    result = drain_with_outcomes_in_one_batch(
        pg_engine,
        ob,
        poisoned=raises(PermanentError("poison-outcome: the database will not take this text")),
        fine=lambda msg: None,
    )

    assert (result.delivered, result.dead) == (1, 1)
    assert statuses(pg_engine) == {"poisoned:1": "dead", "fine:1": "delivered"}
    with pg_engine.connect() as conn:
        names = dict(conn.execute(select(m.c.id, m.c.handler)).all())
    got = {names[h.message_id]: (h.outcome, h.error_type, h.error, h.detail) for h in history(pg_engine)}
    # The database stamps each row with the login that wrote it (outbox_0015).
    assert got["fine"] == ("delivered", None, None, {"db_user": "postgres"})
    outcome, error_type, error, detail = got["poisoned"]
    assert (outcome, error_type, error) == ("dead", "UnstorableError", "the error text could not be stored")
    assert "refused" in detail["unstorable_outcome"]


def test_an_interrupted_drain_hands_back_claims_whose_delivery_never_began(engine, ob, maker):
    ran: list[int] = []

    @ob.handler("e", name="r")
    async def handler(msg):
        ran.append(msg.id)

    emit_many(maker, "e", [{"n": i} for i in range(3)])

    def interrupt(sender, **kwargs):  # Ctrl-C right after the claim, before any delivery exists
        raise KeyboardInterrupt

    signals.message_claimed.connect(interrupt, sender=ob)
    try:
        with pytest.raises(KeyboardInterrupt):
            Relay(ob, engine).run_until_idle()
    finally:
        signals.message_claimed.disconnect(interrupt, sender=ob)
    assert ran == []
    with engine.connect() as conn:
        rows = conn.execute(select(m.c.status, m.c.attempts, m.c.locked_by)).all()
    assert rows == [("pending", 0, None)] * 3, "handed back untouched: no attempt used"
    assert history(engine) == []


# -- the delivery promise against misbehaving receivers and lost replies ---------------------------------


def test_an_outcome_batch_written_twice_leaves_one_history_row_per_attempt(engine, ob, maker):
    """A batch whose COMMIT succeeded but whose reply was lost is sent again by the writer.

    Both write paths: the store's (every database) and, on PostgreSQL, the relay's own connection.
    """
    from outbox.relay.clock import utcnow
    from outbox.relay.store import Completion

    ob.route("e", lambda msg: None, name="r")
    relay = Relay(ob, engine, relay_id="writer")
    paths = ["store", "loop_connection"] if engine.dialect.name == "postgresql" else ["store"]
    for path in paths:
        emit_many(maker, "e", [{"n": 1}, {"n": 2}])
        rows = relay.store.claim("default", ["r"], 10)
        assert len(rows) == 2
        now = utcnow()
        first, second = rows
        batch = [
            Completion(first.id, first.attempts, "delivered", "delivered", started_at=now, finished_at=now),
            Completion(second.id, second.attempts, "failed", "pending", now, now, retry_in=60.0, error="x"),
        ]
        if path == "store":
            relay.store.complete(batch)
            relay.store.complete(batch)
        else:
            asyncio.run(_complete_twice_on_a_loop_connection(relay, engine, batch))
        ids = {first.id, second.id}
        written = sorted((h.message_id, h.attempt, h.outcome) for h in history(engine) if h.message_id in ids)
        assert written == sorted([(first.id, 1, "delivered"), (second.id, 1, "failed")]), path
        with engine.connect() as conn:
            now_status = dict(conn.execute(select(m.c.id, m.c.status).where(m.c.id.in_(ids))).all())
        assert now_status == {first.id: "delivered", second.id: "pending"}, path


async def _complete_twice_on_a_loop_connection(relay: Relay, engine: Engine, batch: list[Any]) -> None:
    from outbox.relay.db import LoopConnection

    conn = LoopConnection(engine, "test write")
    try:
        await relay.store.complete_on(conn, batch)
        await relay.store.complete_on(conn, batch)
    finally:
        await conn.close()


def _expire(engine: Engine, message_id: int, relay_id: str = "ghost") -> None:
    """Leave a message the way a relay killed mid-delivery leaves it: running, attempt charged, and its
    lease running out now (a lease runs out after it was written, so after the recoverer's last look)."""
    with engine.begin() as conn:
        conn.execute(
            m.update()
            .where(m.c.id == message_id)
            .values(
                status="running",
                attempts=m.c.attempts + 1,
                locked_by=relay_id,
                locked_until=datetime.now(UTC),
            )
        )


def _signal_errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == "signal_error"]


def test_a_raising_retry_scheduled_receiver_does_not_stop_lease_recovery(engine, ob, maker, caplog):
    caplog.set_level(logging.ERROR, logger="outbox.relay")
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}, {"n": 2}], delay=3600)  # not due: only a recovery moves them
    with engine.connect() as conn:
        first, second = conn.execute(select(m.c.id).order_by(m.c.id)).scalars()

    def broken_receiver(sender, **kwargs):
        raise RuntimeError("a receiver bug")

    def recovered(message_id: int) -> bool:
        return any(h.outcome == "lease_expired" and h.message_id == message_id for h in history(engine))

    signals.retry_scheduled.connect(broken_receiver, sender=ob)
    relay = Relay(ob, engine, lease=0.2, poll_interval=0.05, listen=False)
    thread = threading.Thread(target=relay.run)
    try:
        _expire(engine, first)
        thread.start()
        wait_until(lambda: recovered(first), "the first expired lease recovered")
        _expire(engine, second)  # after the receiver raised: the recoverer must still be there
        wait_until(lambda: recovered(second), "the second expired lease recovered", timeout=10)
    finally:
        relay.stop()
        thread.join(10)
        signals.retry_scheduled.disconnect(broken_receiver, sender=ob)
    errors = _signal_errors(caplog)
    assert errors and all("broken_receiver" in r.getMessage() for r in errors)
    assert {r.signal for r in errors} == {"retry_scheduled"}  # type: ignore[attr-defined]


def test_a_raising_message_claimed_receiver_neither_stops_the_relay_nor_strands_the_claim(
    engine, ob, maker, caplog
):
    caplog.set_level(logging.ERROR, logger="outbox.relay")
    delivered: list[int] = []
    ob.route("e", lambda msg: delivered.append(msg.payload["n"]), name="r")

    def broken_receiver(sender, **kwargs):
        raise RuntimeError("a receiver bug")

    signals.message_claimed.connect(broken_receiver, sender=ob)
    relay = Relay(ob, engine, poll_interval=0.05, listen=False)
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            relay.run()
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        emit_many(maker, "e", [{"n": 1}, {"n": 2}])
        wait_until(lambda: sorted(delivered) == [1, 2] or failed, "both messages delivered")
    finally:
        relay.stop()
        thread.join(10)
        signals.message_claimed.disconnect(broken_receiver, sender=ob)
    assert failed == [] and sorted(delivered) == [1, 2]
    assert set(statuses(engine).values()) == {"delivered"}
    assert [h.outcome for h in history(engine)] == ["delivered", "delivered"]
    assert _signal_errors(caplog)


def test_a_drain_never_refunds_an_attempt_an_earlier_process_with_the_same_relay_id_made(engine, ob, maker):
    """A stable relay id across runs: the earlier run's claim leaves through lease expiry, charged."""
    ob.route("e", lambda msg: None, name="r")
    emit_many(maker, "e", [{"n": 1}])
    earlier = Relay(ob, engine, relay_id="stable", lease=2)
    assert len(earlier.store.claim("default", ["r"], 10)) == 1  # then that process dies mid-delivery

    result = Relay(ob, engine, relay_id="stable").run_until_idle()
    assert result.attempts == 0
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.attempts, m.c.locked_by)).one() == ("running", 1, "stable")
    assert history(engine) == []

    wait_until(lambda: all_leases_expired(engine), "the earlier run's lease to run out")
    result = Relay(ob, engine, relay_id="stable").run_until_idle()
    assert (result.recovered, result.delivered) == (1, 1)
    outcomes = [(h.outcome, h.relay_id, h.attempt) for h in history(engine)]
    assert outcomes == [("lease_expired", "stable", 1), ("delivered", "stable", 2)]


def test_outcomes_being_written_keep_their_leases(pg_engine, ob):
    """A write that stalls past the lease must not let the message be recovered and delivered again."""
    delivered: list[int] = []
    ob.route("e", lambda msg: delivered.append(msg.id), name="r")
    maker = sessionmaker(pg_engine)
    ob.install(maker)
    blocker = pg_engine.connect()
    relay = Relay(ob, pg_engine, lease=0.6, poll_interval=0.05)
    thread = threading.Thread(target=relay.run)
    try:
        # Every history insert waits for this lock, so the relay's outcome write stalls.
        blocker.execute(text("LOCK TABLE outbox_attempt IN ACCESS EXCLUSIVE MODE"))
        thread.start()
        emit_many(maker, "e", [{"n": 1}])
        (claimed,) = wait_until(lambda: leases(pg_engine), "the claim")
        wait_until(lambda: delivered, "the handler to run")
        now = wait_until(
            lambda: clock(pg_engine) if clock(pg_engine) > claimed + timedelta(seconds=1.5) else None,
            "two and a half leases to pass",
        )
        (renewed,) = leases(pg_engine)
        assert renewed > now - timedelta(seconds=0.6), "the lease was renewed while its outcome was written"
        assert statuses(pg_engine) == {"r:1": "running"}
    finally:
        blocker.rollback()
        blocker.close()
    try:
        wait_until(lambda: statuses(pg_engine) == {"r:1": "delivered"}, "the outcome written")
    finally:
        relay.stop()
        thread.join(10)
        ob.uninstall(maker)
    assert len(delivered) == 1
    assert [h.outcome for h in history(pg_engine)] == ["delivered"]
