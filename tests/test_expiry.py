"""Message expiry: a message no relay handed to its handler by its ``expires_at`` is never handed to it.

Through a real relay on SQLite and PostgreSQL: an expired message is recorded ``expired`` and
ends ``discarded`` without a handler call, announced by log line, signal and metrics, counted
by ``outbox stats``, labelled by ``outbox show`` and the dashboard; one still in time is
delivered, its ``expires_at`` in the handler's hands; one that expires while it waits out a
retry is expired at its next claim. What can only ever expire is refused at emit or route time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_dashboard import Client, text_of

import outbox
from outbox import ConfigurationError, InvalidEmitOption, Message, Outbox, RetryLater, emit, signals
from outbox.cli import main as outbox_main
from outbox.dashboard import create_app
from outbox.relay import Relay
from outbox.relay.metrics import RelayMetrics

m, a = outbox.outbox_message, outbox.outbox_attempt


class Calls:
    """What the handler was given, in order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __call__(self, message: Message) -> None:
        self.messages.append(message)


@pytest.fixture
def calls() -> Calls:
    return Calls()


def _emit(maker: sessionmaker[Session], event_type: str = "order.placed", **options: Any) -> None:
    with maker.begin() as session:
        emit(session, event_type, {"order": 7}, **options)


def _rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def _history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def _database_now(engine: Engine) -> datetime:
    """The clock the relay judges expiry by: the server's on PostgreSQL, this host's on SQLite."""
    if engine.dialect.name != "postgresql":
        return datetime.now(UTC)
    with engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now


def _wait_past(engine: Engine, moment: datetime) -> None:
    while _database_now(engine) <= moment:
        time.sleep(0.02)


@pytest.fixture
def expired_signals() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kw: Any) -> None:
        seen.append(kw)

    signals.message_expired.connect(receiver)
    yield seen
    signals.message_expired.disconnect(receiver)


def test_an_expired_message_is_discarded_and_never_handed_to_its_handler(
    engine, ob, maker, calls, expired_signals, caplog
):
    ob.route("order.placed", calls, name="order_email", expires_after=timedelta(milliseconds=300))
    _emit(maker)
    (row,) = _rows(engine)
    assert row.expires_at == row.created_at + timedelta(milliseconds=300)
    _wait_past(engine, row.expires_at)

    metrics = RelayMetrics()
    with caplog.at_level(logging.WARNING, logger="outbox.relay"):
        result = Relay(ob, engine, metrics=metrics).run_until_idle()

    assert calls.messages == [], "the handler was never called"
    assert (result.expired, result.delivered, result.retried, result.dead) == (1, 0, 0, 0)
    (row,) = _rows(engine)
    assert (row.status, row.attempts, row.locked_by, row.delivered_at) == ("discarded", 1, None, None)
    assert row.last_error.startswith("not handed to the handler: expired at ")
    (history,) = _history(engine)
    assert (history.attempt, history.outcome, history.error_type) == (1, "expired", "Expired")
    assert datetime.fromisoformat(history.detail["expires_at"]) == row.expires_at
    # Announced like every other outcome: a log line, a signal, the deliveries counter.
    (line,) = [r for r in caplog.records if getattr(r, "action", None) == "expired"]
    assert (line.levelname, line.message_id, line.outcome) == ("WARNING", row.id, "expired")
    assert "discarded, not delivered" in line.getMessage()
    (signal,) = expired_signals
    assert (signal["message"].id, signal["message"].expires_at) == (row.id, row.expires_at)
    labels = {"handler": "order_email", "outcome": "expired"}
    assert metrics.registry.get_sample_value("outbox_deliveries_total", labels) == 1
    # Nothing is left to do: the next drain claims nothing.
    assert Relay(ob, engine).run_until_idle().attempts == 0


def test_a_message_in_time_is_delivered_with_its_expiry(engine, ob, maker, calls):
    ob.route("order.placed", calls, name="order_email", expires_after=timedelta(hours=1))
    ob.route("order.placed", Calls(), name="ledger")  # no expiry of its own
    ob.route("order.placed", Calls(), name="audit")
    soon = datetime.now(UTC) + timedelta(minutes=10)
    later = datetime.now(UTC) + timedelta(hours=2)
    _emit(maker, expires_at=later)  # the route's hour comes first for order_email
    _emit(maker, "order.placed", expires_at=soon, key="soon")  # the emit's ten minutes come first
    rows = _rows(engine)
    assert [r.expires_at for r in rows[:3]] == [rows[0].created_at + timedelta(hours=1), later, later]
    assert [r.expires_at for r in rows[3:]] == [soon, soon, soon]

    result = Relay(ob, engine).run_until_idle()

    assert (result.delivered, result.expired) == (6, 0)
    assert {r.status for r in _rows(engine)} == {"delivered"}
    assert [msg.expires_at for msg in calls.messages] == [rows[0].expires_at, soon]


def test_a_message_without_expiry_stores_none(engine, ob, maker, calls):
    ob.route("order.placed", calls, name="order_email")
    _emit(maker)
    assert [r.expires_at for r in _rows(engine)] == [None]
    Relay(ob, engine).run_until_idle()
    assert calls.messages[0].expires_at is None


def test_a_message_that_expires_while_waiting_out_a_retry_is_expired_at_its_next_claim(
    engine, ob, maker, calls
):
    def flaky(message: Message) -> None:
        calls(message)
        raise RetryLater("partner busy", delay=1.5)

    ob.route("order.placed", flaky, name="order_email", expires_after=timedelta(seconds=1))
    _emit(maker)
    first = Relay(ob, engine).run_until_idle()
    assert (first.retried, len(calls.messages)) == (1, 1)
    (row,) = _rows(engine)
    assert (row.status, row.available_at > row.expires_at) == ("pending", True)
    _wait_past(engine, row.available_at)

    second = Relay(ob, engine).run_until_idle()

    assert (second.expired, len(calls.messages)) == (1, 1), "not handed to the handler again"
    assert [(h.attempt, h.outcome) for h in _history(engine)] == [(1, "retry"), (2, "expired")]
    (row,) = _rows(engine)
    assert (row.status, row.attempts) == ("discarded", 2)


# -- refused at emit or route time ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("expires_after", "why"),
    [
        (timedelta(0), "positive timedelta"),
        (timedelta(seconds=-1), "positive timedelta"),
        (60, "positive timedelta"),
        (timedelta(days=3651), "at most 3650 days"),
    ],
    ids=["zero", "negative", "number", "too-far"],
)
def test_a_route_refuses_an_expiry_that_is_not_a_positive_timedelta(expires_after, why):
    ob = Outbox()
    with pytest.raises(ConfigurationError, match=why):
        ob.route("e", lambda msg: None, name="r", expires_after=expires_after)
    assert ob.routes == ()
    with pytest.raises(ConfigurationError, match="expires_after"):
        ob.handler("e", name="r", expires_after=expires_after)(lambda msg: None)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"expires_at": datetime(2099, 1, 1)}, r"aware datetime, got the naive 2099-01-01T00:00:00"),
        ({"expires_at": "2099-01-01T00:00:00Z"}, "aware datetime, got str"),
        ({"expires_at": datetime(2020, 1, 1, tzinfo=UTC)}, "already past"),
        (
            # Minutes from whenever the test runs (parameters are built at collection, minutes earlier).
            {"expires_at": timedelta(minutes=3), "delay": timedelta(minutes=4)},
            "comes before the message is due",
        ),
        ({"delay": timedelta(minutes=5)}, r"not shorter than route 'order_email''s expires_after"),
    ],
    ids=["naive", "text", "past", "delay-past-expiry", "delay-past-route-expiry"],
)
def test_emit_refuses_an_expiry_that_can_only_ever_expire(engine, ob, maker, options, why):
    ob.route("order.placed", lambda msg: None, name="order_email", expires_after=timedelta(minutes=5))
    with maker.begin() as session:
        with pytest.raises(InvalidEmitOption, match=why) as refused:
            if isinstance(options.get("expires_at"), timedelta):
                options = {**options, "expires_at": datetime.now(UTC) + options["expires_at"]}
            emit(session, "order.placed", {"order": 7}, **options)
        assert isinstance(refused.value, ValueError)
        assert "\n" not in str(refused.value)
        emit(session, "order.placed", {"order": 8})  # the transaction is still usable
    assert len(_rows(engine)) == 1


# -- operators see it -----------------------------------------------------------------------------


def test_stats_show_and_the_dashboard_count_and_label_an_expiry(
    engine, database_url, ob, maker, calls, capsys
):
    ob.route("order.placed", calls, name="order_email", expires_after=timedelta(milliseconds=200))
    ob.route("order.shipped", calls, name="shipping_email")
    _emit(maker)
    _emit(maker, "order.shipped", expires_at=datetime.now(UTC) + timedelta(days=1))
    expiring = _rows(engine)[0]
    _wait_past(engine, expiring.expires_at)
    Relay(ob, engine).run_until_idle()
    assert len(calls.messages) == 1

    assert outbox.ops.stats(engine).expired_last_hour == 1
    assert outbox_main(["stats", "--json", "--database-url", database_url]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert (figures["expired_last_hour"], figures["delivered_last_hour"]) == (1, 1)
    assert outbox_main(["stats", "--database-url", database_url]) == 0
    assert "last hour: 1 delivered, 0 failed attempts, 1 expired" in capsys.readouterr().out.splitlines()

    assert outbox_main(["show", str(expiring.id), "--database-url", database_url]) == 0
    shown = capsys.readouterr().out
    (row,) = [line for line in shown.splitlines() if "expired, not sent" in line]
    assert "not handed to the handler: expired at " in row
    assert f"expires_at: {expiring.expires_at}" in shown

    with Client(create_app(engine)) as dashboard:
        overview = text_of(dashboard.get("/").text)
        page = text_of(dashboard.get(f"/messages/{expiring.id}").text)
    assert "delivered 1 retried 0 died 0 expired 1" in overview
    assert "Expires" in page and "expired" in page and "not handed to the handler" in page


# -- the database's word ------------------------------------------------------------------------


def test_the_database_hands_back_an_expiry_it_does_not_agree_with(pg_engine, ob, calls):
    """The relay judged by the claim's clock; if the row changed since, the next claim judges again."""
    maker = sessionmaker(pg_engine)
    ob.install(maker)
    ob.route("order.placed", calls, name="order_email", expires_after=timedelta(milliseconds=200))
    with pg_engine.begin() as conn:  # moved on at its first claim, after the claim read it
        conn.execute(
            text(
                """
                CREATE FUNCTION postpone_expiry() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    NEW.expires_at := now() + interval '1 hour';
                    RETURN NEW;
                END $$;
                CREATE TRIGGER postpone_expiry BEFORE UPDATE ON outbox_message FOR EACH ROW
                    WHEN (OLD.status = 'pending' AND NEW.status = 'running' AND OLD.attempts = 0)
                    EXECUTE FUNCTION postpone_expiry();
                """
            )
        )
    _emit(maker)
    (row,) = _rows(pg_engine)
    _wait_past(pg_engine, row.expires_at)

    result = Relay(ob, pg_engine).run_until_idle()

    assert (result.delivered, result.expired) == (1, 0)
    assert len(calls.messages) == 1
    history = _history(pg_engine)
    assert [(h.attempt, h.outcome) for h in history] == [(1, "retry"), (1, "delivered")]
    assert history[0].detail["counted"] is False and "has not expired" in history[0].detail["refused"]
    assert _rows(pg_engine)[0].status == "delivered"
    ob.uninstall(maker)


def test_a_relay_on_a_database_before_outbox_0018_says_to_migrate(database_url, ob):
    outbox._migrations.downgrade(database_url, "outbox_0017")
    ob.route("order.placed", lambda msg: None, name="order_email")
    with pytest.raises(
        outbox.OutboxError, match=r"older than this relay \(no outbox_message.expires_at\).*outbox migrate"
    ):
        Relay(ob, database_url).run_until_idle()


def test_the_downgrade_refuses_while_expiries_are_on_record(database_url, engine, ob, maker):
    ob.route("order.placed", lambda msg: None, name="order_email", expires_after=timedelta(milliseconds=100))
    _emit(maker)
    _wait_past(engine, _rows(engine)[0].expires_at)
    assert Relay(ob, engine).run_until_idle().expired == 1
    with pytest.raises(RuntimeError, match="1 history row.s. record an expiry"):
        outbox._migrations.downgrade(database_url, "outbox_0017")
    assert outbox.upgrade(database_url) == []
