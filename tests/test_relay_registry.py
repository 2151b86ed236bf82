"""The relay registry on real SQLite and PostgreSQL: rows serving relays write, read by ``ops.relays``."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from relayproc import wait_until
from sqlalchemy import delete, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from test_webhook import LOCAL, SECRET, Receiver, Reply, serve

import outbox
from outbox import ConfigurationError, Outbox, emit
from outbox.integrations.webhook import WebhookHandler
from outbox.ops import OpsError, RelaySeen, relays
from outbox.relay import Relay

r = outbox.outbox_relay_registry
m = outbox.outbox_message

PERIOD = 0.1  # the registry interval these relays run with


@pytest.fixture
def failing_receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.default = Reply(500, body=b"down")
    yield from serve(receiver)


def emit_one(maker: sessionmaker[Session], event_type: str, payload: dict[str, Any]) -> None:
    with maker.begin() as s:
        emit(s, event_type, payload)


class Serving:
    """A relay serving on a thread, stopped (cleanly) by the test or at teardown."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.thread = threading.Thread(target=relay.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.relay.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the relay did not stop"


def serving(ob: Outbox, engine: Engine, relay_id: str, **options: Any) -> Serving:
    options = {"poll_interval": 0.05, "listen": False, "registry_interval": PERIOD, **options}
    return Serving(Relay(ob, engine, relay_id=relay_id, **options))


def seen(engine: Engine, relay_id: str) -> RelaySeen | None:
    return next((found for found in relays(engine, period=PERIOD) if found.relay_id == relay_id), None)


def test_a_serving_relay_shows_what_it_holds_and_its_breakers_then_its_clean_stop(
    engine, ob, maker, failing_receiver
):
    hook = WebhookHandler(
        failing_receiver.url(),
        SECRET,
        allowed_networks=LOCAL,
        breaker_threshold=1,
        breaker_cooldown=60,
        rate_limit=20,
    )
    ob.route("order.paid", hook, name="partner", max_attempts=10)
    release = asyncio.Event()
    started = threading.Event()

    async def slow(msg: Any) -> None:
        started.set()
        while not release.is_set():
            await asyncio.sleep(0.01)

    ob.route("report.asked", slow, name="reporter", timeout=30)
    emit_one(maker, "order.paid", {"order_id": 1})
    emit_one(maker, "report.asked", {"n": 1})

    relay = serving(ob, engine, "reg-a")
    try:
        assert started.wait(10)
        host = f"127.0.0.1:{failing_receiver.port}"
        first = wait_until(
            lambda: (
                (row := seen(engine, "reg-a")) is not None
                and row.in_flight == 1
                and row.handlers["partner"].breakers == {host: True}
                and row
            ),
            "the row to show the running delivery and the open breaker",
        )
        assert (first.host, first.pid, first.queues, first.stopped_at) == (
            socket.gethostname(),
            os.getpid(),
            None,
            None,
        )
        assert first.alive and first.started_at <= first.seen_at
        assert first.handlers["partner"].open_breakers == [host]
        assert first.handlers["partner"].rate_limit == 20.0
        assert (first.handlers["reporter"].breakers, first.handlers["reporter"].rate_limit) == ({}, None)

        later = wait_until(
            lambda: (row := seen(engine, "reg-a")) is not None and row.seen_at > first.seen_at and row,
            "seen_at to advance",
        )
        assert later.started_at == first.started_at
    finally:
        release.set()
        relay.stop()

    stopped = seen(engine, "reg-a")
    assert stopped is not None and stopped.stopped_at is not None
    assert stopped.stopped_at >= later.seen_at and stopped.seen_at == stopped.stopped_at
    assert (stopped.alive, stopped.in_flight) == (False, 0)
    assert stopped.as_dict()["handlers"]["partner"]["breakers"] == {host: True}


def test_a_relay_restarted_with_the_same_id_takes_its_row_over(engine, ob):
    ob.route("e", lambda msg: None, name="r", queue="billing")
    first = serving(ob, engine, "same", queues=["billing"])
    wait_until(lambda: seen(engine, "same"), "the first start's row")
    first.stop()
    before = seen(engine, "same")
    assert before is not None and before.stopped_at is not None and before.queues == ("billing",)

    again = serving(ob, engine, "same")
    try:
        after = wait_until(
            lambda: (row := seen(engine, "same")) is not None and row.stopped_at is None and row,
            "the restart to take the row over",
        )
        assert after.started_at > before.started_at and after.alive and after.queues is None
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(r)).scalar_one() == 1
    finally:
        again.stop()


def test_a_registry_the_relay_cannot_write_never_stops_delivery(engine, ob, maker, caplog):
    delivered: list[int] = []
    ob.route("e", lambda msg: delivered.append(msg.payload["n"]), name="r")
    caplog.set_level(logging.INFO, logger="outbox.relay")
    relay = serving(ob, engine, "unlucky")
    try:
        wait_until(lambda: seen(engine, "unlucky"), "the row")
        with engine.begin() as conn:
            r.drop(conn)
        for n in range(3):  # delivered across many registry periods, every write failing
            emit_one(maker, "e", {"n": n})
            wait_until(lambda n=n: n in delivered, f"message {n} to be delivered")
            wait_until(lambda: _actions(caplog).count("registry_error") == 1, "the failure to be logged")
        assert relay.thread.is_alive()
        assert _actions(caplog).count("registry_error") == 1, "logged once per streak, not once per period"

        with engine.begin() as conn:
            r.create(conn)
        wait_until(lambda: seen(engine, "unlucky"), "the row to be written again")
        # The recovery is logged just after the write that proves it commits.
        wait_until(lambda: "registry_ok" in _actions(caplog), "the recovery to be logged")
    finally:
        relay.stop()
    assert delivered == [0, 1, 2]
    assert "task_restart" not in _actions(caplog)
    final = seen(engine, "unlucky")
    assert final is not None and final.stopped_at is not None


def _actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(record, "action", "") for record in caplog.records]


def test_relays_lists_the_most_recently_seen_first_and_a_silent_relay_as_not_alive(engine):
    now = datetime.now(UTC)
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            now = conn.execute(select(func.now())).scalar_one()
    row = {"host": "h", "pid": 1, "queues": [], "handlers": {}, "started_at": now - timedelta(hours=1)}
    with engine.begin() as conn:
        conn.execute(
            insert(r),
            [
                {**row, "relay_id": "crashed", "seen_at": now - timedelta(seconds=16)},
                {**row, "relay_id": "live", "seen_at": now + timedelta(seconds=1)},
                {**row, "relay_id": "late", "seen_at": now - timedelta(seconds=9)},
            ],
        )
    found = relays(engine)
    assert [(f.relay_id, f.alive) for f in found] == [("live", True), ("late", True), ("crashed", False)]
    assert [f.relay_id for f in relays(engine, period=1)] == ["live", "late", "crashed"]
    assert [f.alive for f in relays(engine, period=1)] == [True, False, False]
    assert found[0].in_flight == 0 and found[0].queues is None
    with engine.begin() as conn:
        conn.execute(delete(r))
    assert relays(engine) == []
    with pytest.raises(OpsError, match="period"):
        relays(engine, period=0)


def test_a_draining_relay_writes_no_row_and_a_bad_interval_is_refused(engine, ob, maker):
    ob.route("e", lambda msg: None, name="r")
    emit_one(maker, "e", {"n": 1})
    assert Relay(ob, engine).run_until_idle().delivered == 1
    assert relays(engine) == []
    with pytest.raises(ConfigurationError, match="registry_interval"):
        Relay(ob, engine, registry_interval=0)
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status)).scalar_one() == "delivered"


class BrokenReport:
    """A handler whose breaker report always raises (user code)."""

    def __call__(self, msg: Any) -> None:
        pass

    def outbox_breaker_states(self) -> dict[str, bool]:
        raise RuntimeError("breaker report bug")


def test_a_raising_breaker_report_leaves_its_breakers_out_and_is_logged_once(engine, ob, caplog):
    ob.route("e", BrokenReport(), name="broken")
    caplog.set_level(logging.INFO, logger="outbox.relay")
    relay = serving(ob, engine, "hooked")
    try:
        first = wait_until(lambda: seen(engine, "hooked"), "the row")
        wait_until(
            lambda: (row := seen(engine, "hooked")) is not None and row.seen_at > first.seen_at,
            "a refresh after the first write",
        )
    finally:
        relay.stop()
    final = seen(engine, "hooked")
    assert final is not None and final.handlers["broken"].breakers == {}
    errors = [rec for rec in caplog.records if getattr(rec, "action", "") == "registry_error"]
    assert [(rec.handler, bool(rec.exc_info)) for rec in errors] == [("broken", True)]
