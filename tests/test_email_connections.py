"""EmailHandler's cap on open SMTP connections, against a real aiosmtpd server on 127.0.0.1.

The server counts the conversations it holds at once; the relay runs many more
deliveries at once than the cap allows.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from test_email import free_port

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, RetryLater, emit
from outbox.integrations.email import EmailHandler
from outbox.relay import Relay

m = outbox.outbox_message


class Counting:
    """Holds each DATA for ``hold`` seconds and records how many were held at once."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.active = 0
        self.peak = 0
        self.accepted = 0

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.hold)
        finally:
            self.active -= 1
        self.accepted += 1
        return "250 2.0.0 queued"


def serve(request: pytest.FixtureRequest, hold: float) -> tuple[Counting, int]:
    counting = Counting(hold)
    controller = Controller(counting, hostname="127.0.0.1", port=free_port())
    controller.start()
    request.addfinalizer(controller.stop)
    return counting, int(controller.port)


def drain(engine: Engine, port: int, count: int, **options: Any) -> None:
    ob = Outbox(default_backoff=Backoff(base=0.01, cap=0.05))
    handler = EmailHandler("127.0.0.1", port, sender="shop@example.com", sent_log=False, **options)
    ob.route("mail", handler, name="mailer", max_attempts=1, timeout=20)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        for n in range(count):
            emit(s, "mail", {"to": f"u{n}@example.com", "subject": "S", "text": "t"})
    result = Relay(ob, engine, concurrency=count, poll_interval=0.05).run_until_idle()
    assert result.delivered == count, result


@pytest.mark.parametrize("cap", [3, None], ids=["capped", "uncapped"])
def test_a_busy_relay_opens_no_more_connections_than_the_cap_and_sends_everything_once(engine, request, cap):
    counting, port = serve(request, hold=0.05)
    drain(engine, port, 24, max_connections=cap)
    assert counting.accepted == 24
    if cap is None:
        assert counting.peak > 3  # the control: without the cap the relay's 24 deliveries overlap
    else:
        assert counting.peak == cap
    with engine.connect() as conn:
        # max_attempts=1: a refused connection would have made a message dead, not delivered
        assert {r.status for r in conn.execute(select(m.c.status))} == {"delivered"}


def test_the_default_cap_is_ten_connections(engine, request):
    counting, port = serve(request, hold=0.05)
    drain(engine, port, 40)
    assert counting.accepted == 40
    assert counting.peak == 10


def test_a_delivery_that_finds_every_connection_busy_is_deferred_without_using_an_attempt(request):
    counting, port = serve(request, hold=3.2)
    handler = EmailHandler(
        "127.0.0.1", port, sender="shop@example.com", sent_log=False, max_connections=1, timeout=4
    )
    message = Message(
        id=1,
        event_id=uuid.uuid4(),
        event_type="mail",
        handler="mailer",
        payload={"to": "a@example.com", "subject": "S", "text": "t"},
        key="k",
    )
    first = threading.Thread(target=handler, args=(message,))
    first.start()
    while counting.active == 0:  # the first conversation holds the only connection
        time.sleep(0.01)
    began = time.monotonic()
    with pytest.raises(RetryLater) as deferred:
        handler(message)
    waited = time.monotonic() - began
    first.join()
    assert deferred.value.counts_as_attempt is False
    assert deferred.value.detail == {
        "reason": "connections_busy",
        "smtp_host": "127.0.0.1",
        "max_connections": 1,
    }
    assert "nothing sent" in str(deferred.value)
    assert waited >= 1.9  # it waited half the SMTP timeout for the connection before giving up
    assert counting.accepted == 1
    counting.hold = 0.01
    handler(message)  # the connection was given back
    assert counting.accepted == 2


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "10"])
def test_a_bad_max_connections_is_refused_at_construction(value):
    with pytest.raises(ConfigurationError, match="max_connections must be an integer >= 1 or None"):
        EmailHandler("127.0.0.1", 25, sender="shop@example.com", max_connections=value)
