"""Circuit breakers every relay shares, against real relays, a real HTTP receiver and real databases.

Two relays in these tests are two :class:`Relay` objects with two relay ids and
two ``Outbox`` objects, each with its own ``WebhookHandler`` (its own
in-memory breaker), as two relay processes would have: what one knows, the
other can only learn through ``outbox_breaker``. Relay A serves queue ``a`` and
relay B queue ``b``, so a test knows which relay a message goes to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from relayproc import wait_until
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_dashboard import Client, text_of
from test_ops_cli import assert_one_line_error, ok, ok_json, run
from test_relay_registry import Serving
from test_webhook import LOCAL, SECRET, Receiver, Reply, serve

import outbox
from outbox import Backoff, Outbox, emit, ops
from outbox._breaker_board import READ_INTERVAL
from outbox.dashboard import create_app
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt
blog = outbox.outbox_breaker_log

COOLDOWN = 60.0  # long enough that nothing reopens on its own while a test runs


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A receiver that fails (500) until a test brings it back."""
    found = Receiver()
    found.default = Reply(500, body=b"down")
    yield from serve(found)


def shop(receiver: Receiver, *, threshold: int = 2, cooldown: float = COOLDOWN) -> Outbox:
    """One relay process's Outbox: its own webhook handler, so its own in-memory breaker."""
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    handler = WebhookHandler(
        receiver.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=threshold, breaker_cooldown=cooldown
    )
    ob.route("order.paid", handler, name="partner", max_attempts=50)
    return ob


def handler_of(ob: Outbox) -> WebhookHandler:
    (route,) = ob.routes
    assert isinstance(route.handler, WebhookHandler)
    return route.handler


def emit_to(maker: sessionmaker[Session], queue: str, order: int) -> int:
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": order}, queue=queue)
    with maker() as s:
        return int(s.execute(select(m.c.id).order_by(m.c.id.desc()).limit(1)).scalar_one())


def status(engine: Engine, message_id: int) -> str:
    with engine.connect() as conn:
        return str(conn.execute(select(m.c.status).where(m.c.id == message_id)).scalar_one())


def history(engine: Engine, message_id: int) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).where(a.c.message_id == message_id).order_by(a.c.id)))


def breaker_log(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(blog).order_by(blog.c.id)))


def relay(ob: Outbox, engine: Engine, relay_id: str, queue: str, **options: Any) -> Serving:
    return Serving(Relay(ob, engine, relay_id=relay_id, queues=[queue], poll_interval=0.05, **options))


@pytest.fixture
def two_shops(receiver: Receiver) -> tuple[Outbox, Outbox]:
    return shop(receiver), shop(receiver)


@pytest.fixture
def pg_maker(pg_engine: Engine, two_shops: tuple[Outbox, Outbox]) -> Iterator[sessionmaker[Session]]:
    factory = sessionmaker(pg_engine)
    two_shops[0].install(factory)
    yield factory
    two_shops[0].uninstall(factory)


def opened_by_relay_a(receiver: Receiver, engine: Engine, maker: sessionmaker[Session]) -> tuple[str, int]:
    """Relay A fails twice against the receiver and opens the breaker; its destination and message."""
    first = emit_to(maker, "a", 1)
    found = wait_until(lambda: ops.breakers(engine), "relay A to record the breaker it opened")
    destination = f"127.0.0.1:{receiver.port}"
    assert [(b.destination, b.route, b.state, b.failures, b.opened_by) for b in found] == [
        (destination, "partner", "open", 2, "relay-a")
    ]
    assert len(receiver.requests) == 2  # two failures opened it; the retry after that was not sent
    wait_until(
        lambda: any(h.detail.get("breaker") == "open" for h in history(engine, first)), "relay A to defer"
    )
    return destination, first


def test_two_relays_share_an_opening_and_a_reset(pg_engine, pg_url, pg_maker, two_shops, receiver):
    shop_a, shop_b = two_shops
    relay_a = relay(shop_a, pg_engine, "relay-a", "a")
    relay_b = relay(shop_b, pg_engine, "relay-b", "b")
    try:
        destination, first = opened_by_relay_a(receiver, pg_engine, pg_maker)
        # The receiver is back, but neither breaker knows: relay B must skip it on A's word alone,
        # from its next read of the table (at most a second later) on.
        receiver.default = Reply(200)
        time.sleep(2 * READ_INTERVAL)
        second = emit_to(pg_maker, "b", 2)
        wait_until(lambda: history(pg_engine, second), "relay B to attempt")
        (skip,) = history(pg_engine, second)
        assert (skip.relay_id, skip.outcome) == ("relay-b", "retry")
        assert skip.detail["breaker"] == "open" and skip.detail["destination"] == destination
        assert skip.detail["counted"] is False
        assert len(receiver.requests) == 2, "relay B sent nothing"
        assert handler_of(shop_b).outbox_breaker_states() == {destination: True}

        listed = ok_json(run("breaker", "list", "--json", database_url=pg_url))
        assert [(x["destination"], x["route"], x["state"], x["failures"]) for x in listed] == [
            (destination, "partner", "open", 2)
        ]
        assert {"since", "reopen_at", "opened_by"} <= set(listed[0])
        table = ok(run("breaker", "list", database_url=pg_url))
        assert table.splitlines()[0].split() == [
            "destination",
            "route",
            "state",
            "since",
            "failures",
            "reopen",
            "at",
            "opened",
            "by",
        ]
        assert destination in table and "relay-a" in table

        said = ok(
            run(
                "breaker",
                "reset",
                destination,
                "--reason",
                "partner is back",
                "--actor",
                "alice",
                database_url=pg_url,
            )
        )
        assert f"reset the circuit breaker for {destination} (route partner" in said
        reset_at = time.monotonic()
        # Both relays send again at once: each checks a fresh read before turning a delivery away.
        third, fourth = emit_to(pg_maker, "a", 3), emit_to(pg_maker, "b", 4)
        wait_until(
            lambda: status(pg_engine, third) == status(pg_engine, fourth) == "delivered",
            "both relays to deliver",
            timeout=10,
        )
        assert time.monotonic() - reset_at < 1.5 + READ_INTERVAL
        assert [r.relay_id for r in history(pg_engine, third)] == ["relay-a"]
        assert [r.relay_id for r in history(pg_engine, fourth)] == ["relay-b"]
        # What the breaker deferred keeps its time (the rest of the cool-down): retry-now sends it.
        assert status(pg_engine, first) == status(pg_engine, second) == "pending"
        wait_until(
            lambda: (
                handler_of(shop_a).outbox_breaker_states() == {destination: False}
                and handler_of(shop_b).outbox_breaker_states() == {destination: False}
            ),
            "both breakers to be closed",
        )
    finally:
        relay_a.stop()
        relay_b.stop()
    assert ops.breakers(pg_engine) == []
    opened, reset = breaker_log(pg_engine)
    assert (opened.event, opened.relay_id, opened.failures, opened.handler) == (
        "opened",
        "relay-a",
        2,
        "partner",
    )
    assert (reset.event, reset.actor, reset.reason, reset.relay_id) == (
        "reset",
        "alice",
        "partner is back",
        None,
    )
    assert opened.db_user == reset.db_user == "postgres"  # the login, stamped by the database


def test_retry_now_clears_the_breaker_for_every_relay(pg_engine, pg_url, pg_maker, two_shops, receiver):
    shop_a, shop_b = two_shops
    relay_a = relay(shop_a, pg_engine, "relay-a", "a")
    relay_b = relay(shop_b, pg_engine, "relay-b", "b")
    try:
        destination, first = opened_by_relay_a(receiver, pg_engine, pg_maker)
        time.sleep(2 * READ_INTERVAL)
        second = emit_to(pg_maker, "b", 2)
        wait_until(lambda: history(pg_engine, second), "relay B to defer")
        assert len(receiver.requests) == 2
        receiver.default = Reply(200)

        made_due = ok_json(
            run(
                "retry-now",
                "--handler",
                "partner",
                "--reason",
                "partner is back",
                "--actor",
                "bob",
                "--yes",
                "--json",
                database_url=pg_url,
            )
        )
        started = time.monotonic()
        assert made_due == {"retried_now": [first, second]}
        # Made due and woken at once: neither relay may defer them again for the cool-down.
        wait_until(
            lambda: status(pg_engine, first) == status(pg_engine, second) == "delivered",
            "both messages to be delivered",
            timeout=10,
        )
        assert time.monotonic() - started < 1.5 + READ_INTERVAL
        assert len(receiver.requests) == 4
    finally:
        relay_a.stop()
        relay_b.stop()
    assert ops.breakers(pg_engine) == []
    cleared = breaker_log(pg_engine)[-1]
    assert (cleared.event, cleared.destination, cleared.actor, cleared.reason) == (
        "retried_now",
        destination,
        "bob",
        "partner is back",
    )


def test_a_successful_trial_closes_the_breaker_for_every_relay(pg_engine, pg_maker, receiver):
    receiver.default = Reply(503, body=b"unavailable")  # a trial every cool-down, none counted
    shop_a, shop_b = shop(receiver, cooldown=1.0), shop(receiver, cooldown=1.0)
    relay_a = relay(shop_a, pg_engine, "relay-a", "a")
    relay_b = relay(shop_b, pg_engine, "relay-b", "b")
    factory = sessionmaker(pg_engine)
    shop_a.install(factory)
    try:
        first = emit_to(factory, "a", 1)
        wait_until(lambda: ops.breakers(pg_engine), "relay A to open the breaker")
        destination = f"127.0.0.1:{receiver.port}"
        # Relay B meets the breaker (it defers a message), then the receiver comes back.
        time.sleep(2 * READ_INTERVAL)
        second = emit_to(factory, "b", 2)
        wait_until(lambda: history(pg_engine, second), "relay B to defer")
        assert handler_of(shop_b).outbox_breaker_states() == {destination: True}
        receiver.default = Reply(200)
        wait_until(lambda: status(pg_engine, first) == "delivered", "relay A's trial to deliver")
        wait_until(lambda: not ops.breakers(pg_engine), "the trial to close the shared breaker")
        wait_until(
            lambda: handler_of(shop_b).outbox_breaker_states() == {destination: False},
            "relay B's breaker to close",
            timeout=5,
        )
        wait_until(lambda: status(pg_engine, second) == "delivered", "relay B to deliver")
    finally:
        relay_a.stop()
        relay_b.stop()
        shop_a.uninstall(factory)
    events = [(row.event, row.relay_id) for row in breaker_log(pg_engine)]
    assert events[0] == ("opened", "relay-a")
    assert events[1][0] == "closed"  # by whichever trial succeeded first: relays send one each at most


# -- one relay, SQLite and PostgreSQL -----------------------------------------------------------


def drain(ob: Outbox, engine: Engine) -> None:
    """Deliver what is due, as ``outbox-relay --once`` would: a fresh relay run, which reads the table."""
    Relay(ob, engine, relay_id="solo").run_until_idle()


@pytest.fixture
def solo(engine: Engine, receiver: Receiver) -> Iterator[tuple[Outbox, sessionmaker[Session]]]:
    ob = shop(receiver, threshold=1)
    factory = sessionmaker(engine)
    ob.install(factory)
    yield ob, factory
    ob.uninstall(factory)


def test_one_relay_records_its_breaker_and_a_restart_still_skips_the_destination(engine, solo, receiver):
    ob, factory = solo
    first = emit_to(factory, "default", 1)
    drain(ob, engine)
    destination = f"127.0.0.1:{receiver.port}"
    (found,) = ops.breakers(engine)
    assert (found.destination, found.route, found.state, found.failures, found.opened_by) == (
        destination,
        "partner",
        "open",
        1,
        "solo",
    )
    assert 55 < (found.reopen_at - found.since).total_seconds() <= COOLDOWN
    assert len(receiver.requests) == 1

    # A restarted relay (a new handler, nothing in memory) skips it from its first delivery on.
    receiver.default = Reply(200)
    restarted = shop(receiver, threshold=1)
    second = emit_to(factory, "default", 2)
    drain(restarted, engine)
    assert len(receiver.requests) == 1
    (skip,) = history(engine, second)
    assert skip.detail["breaker"] == "open" and skip.detail["counted"] is False
    assert 0 < skip.detail["retry_in"] <= COOLDOWN
    assert handler_of(restarted).outbox_breaker_states() == {destination: True}

    was = ops.reset_breaker(engine, destination, reason="partner is back", actor="alice")
    assert (was.destination, was.route, was.failures) == (destination, "partner", 1)
    third = emit_to(factory, "default", 3)
    drain(restarted, engine)
    assert status(engine, third) == "delivered"
    assert status(engine, first) == status(engine, second) == "pending"  # deferred: they keep their time
    assert handler_of(restarted).outbox_breaker_states() == {destination: False}
    assert ops.breakers(engine) == []
    logged = [(r.event, r.destination, r.relay_id, r.actor, r.reason) for r in breaker_log(engine)]
    assert logged == [
        ("opened", destination, "solo", None, None),
        ("reset", destination, None, "alice", "partner is back"),
    ]
    expected_login = "postgres" if engine.dialect.name == "postgresql" else None
    assert {r.db_user for r in breaker_log(engine)} == {expected_login}


def test_retry_now_clears_the_breakers_of_what_it_makes_due(engine, solo, receiver):
    ob, factory = solo
    first = emit_to(factory, "default", 1)
    drain(ob, engine)  # fails, opens the breaker, is deferred by it
    assert [h.detail.get("breaker") for h in history(engine, first)] == [None, "open"]
    receiver.default = Reply(200)
    done = ops.retry_now(engine, ops.MessageFilter(ids=(first,)), reason="partner is back", actor="bob")
    assert done == [first]
    assert ops.breakers(engine) == []
    drain(ob, engine)  # the same relay process, its breaker open in memory: it follows the table
    assert status(engine, first) == "delivered"
    assert len(receiver.requests) == 2
    cleared = breaker_log(engine)[-1]
    assert (cleared.event, cleared.actor, cleared.reason) == ("retried_now", "bob", "partner is back")


def test_retry_now_of_a_message_its_route_never_deferred_clears_its_routes_breaker(engine, receiver):
    """A message that failed before the breaker opened names no destination: its route does."""
    ob = shop(receiver, threshold=2)
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        first, second = emit_to(factory, "default", 1), emit_to(factory, "default", 2)
        # One failure each, then each waits out a long backoff: the breaker defers neither.
        slow = Outbox(default_backoff=Backoff(base=600, cap=600))
        slow.route("order.paid", handler_of(ob), name="partner", max_attempts=50)
        drain(slow, engine)
        assert len(receiver.requests) == 2 and len(ops.breakers(engine)) == 1
        assert all(h.detail.get("breaker") is None for i in (first, second) for h in history(engine, i))
        ops.retry_now(engine, ops.MessageFilter(ids=(first,)), reason="partner is back", actor="bob")
        assert ops.breakers(engine) == []
    finally:
        ob.uninstall(factory)


def test_stats_and_the_cli_show_open_breakers_and_refuse_what_is_not_open(
    database_url, engine, solo, receiver
):
    ob, factory = solo
    emit_to(factory, "default", 1)
    drain(ob, engine)
    destination = f"127.0.0.1:{receiver.port}"
    assert [b.destination for b in ops.stats(engine).breakers] == [destination]
    assert ok_json(run("stats", "--json", database_url=database_url))["breakers"][0]["route"] == "partner"
    shown = ok(run("stats", database_url=database_url))
    assert f"circuit breaker open: {destination} (route partner) since" in shown

    assert_one_line_error(
        run("breaker", "reset", "127.0.0.1:1", "--reason", "r", database_url=database_url),
        1,
        "outbox breaker reset: no circuit breaker is open for '127.0.0.1:1'",
        f"(open now: {destination})",
    )
    assert_one_line_error(
        run("breaker", "reset", destination, "--reason", "  ", database_url=database_url),
        1,
        "a reason is required",
    )
    assert_one_line_error(run("breaker", "reset", destination, database_url=database_url), 2, "--reason")
    assert_one_line_error(run("breaker", "list", "--bogus", database_url=database_url), 2)
    assert_one_line_error(run("breaker", "--json", database_url=database_url), 2, "VERB")
    assert ops.breakers(engine) != []  # nothing was reset by the refusals
    reset = ok_json(
        run("breaker", "reset", destination, "--reason", "back", "--json", database_url=database_url)
    )
    assert reset["reset"]["destination"] == destination and reset["reset"]["state"] == "open"
    assert ok(run("breaker", "list", database_url=database_url)).strip() == "no circuit breaker is open"
    assert ok_json(run("breaker", "list", "--json", database_url=database_url)) == []
    with pytest.raises(ops.BreakerNotOpen, match="none is open"):
        ops.reset_breaker(engine, destination, reason="again", actor="alice")


def test_the_breaker_log_is_append_only(engine, solo):
    ob, factory = solo
    emit_to(factory, "default", 1)
    drain(ob, engine)
    refusals = ["UPDATE outbox_breaker_log SET actor = 'someone else'", "DELETE FROM outbox_breaker_log"]
    if engine.dialect.name == "postgresql":
        refusals.append("TRUNCATE outbox_breaker_log")
    for statement in refusals:
        with pytest.raises(Exception, match="outbox_breaker_log is append-only"), engine.begin() as conn:
            conn.execute(text(statement))
    assert len(breaker_log(engine)) == 1


def test_the_downgrade_keeps_the_breaker_log(empty_url):
    outbox.upgrade(empty_url)
    engine = create_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                blog.insert().values(
                    event="reset",
                    destination="partner.example:443",
                    handler="partner",
                    at=datetime.now(UTC),
                    actor="alice",
                    reason="r",
                )
            )
    finally:
        engine.dispose()
    with pytest.raises(RuntimeError, match="outbox_breaker_log records 1"):
        outbox._migrations.downgrade(empty_url, "outbox_0018")


# -- the database cannot be asked ----------------------------------------------------------------


def test_a_relay_keeps_delivering_when_the_breaker_table_cannot_be_read(engine, caplog):
    """Breakers then decide on their own, and a healthy destination is delivered to as ever."""
    caplog.set_level(logging.INFO, logger="outbox.breakers")
    down, up = Receiver(), Receiver()
    down.default = Reply(500, body=b"down")
    receivers = [serve(down), serve(up)]
    for started in receivers:
        next(started)
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    for name, target in (("down", down), ("up", up)):
        handler = WebhookHandler(
            target.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=1, breaker_cooldown=COOLDOWN
        )
        ob.route(f"order.{name}", handler, name=name, max_attempts=50)
    factory = sessionmaker(engine)
    ob.install(factory)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox_breaker RENAME TO outbox_breaker_away"))
    serving = Serving(Relay(ob, engine, relay_id="solo", poll_interval=0.05))
    try:
        with factory.begin() as s:
            emit(s, "order.down", {"n": 1})
        wait_until(lambda: handler_of_route(ob, "down").outbox_breaker_states(), "the breaker to open")
        for n in range(3):
            with factory.begin() as s:
                emit(s, "order.up", {"n": n})
                emit(s, "order.down", {"n": n + 10})
        wait_until(lambda: len(up.requests) == 3, "the healthy destination to get every message")
        time.sleep(2 * READ_INTERVAL + 0.2)  # reads keep failing meanwhile
        assert len(down.requests) == 1, "the open breaker held the others back, on its own"
        errors = [r for r in caplog.records if getattr(r, "action", "") == "breaker_error"]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert "outbox_breaker" in errors[0].getMessage()

        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE outbox_breaker_away RENAME TO outbox_breaker"))
        wait_until(
            lambda: any(getattr(r, "action", "") == "breaker_ok" for r in caplog.records),
            "the table to be read again",
        )
    finally:
        serving.stop()
        ob.uninstall(factory)
        for started in receivers:
            next(started, None)


def handler_of_route(ob: Outbox, name: str) -> WebhookHandler:
    (route,) = [r for r in ob.routes if r.name == name]
    assert isinstance(route.handler, WebhookHandler)
    return route.handler


def test_the_dashboard_overview_shows_open_breakers(engine, solo, receiver):
    with Client(create_app(engine)) as reader:
        assert "No circuit breaker is open" in text_of(reader.get("/").text)
        ob, factory = solo
        emit_to(factory, "default", 1)
        drain(ob, engine)
        page = text_of(reader.get("/").text)
    destination = f"127.0.0.1:{receiver.port}"
    assert f"{destination} partner open" in page
    assert "Opened by" in page and " solo " in page
