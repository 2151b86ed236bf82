"""WebhookHandler's cap on the requests open to one host, against real HTTP receivers on 127.0.0.1.

Each receiver holds every request for a moment and records how many it held at
once; the relay runs many more deliveries at once than the cap allows.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from test_webhook import LOCAL, SECRET, Received, Receiver, Reply, message, serve

import outbox
from outbox import Backoff, ConfigurationError, Outbox, RetryLater, emit
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt


class Holding:
    """Answers 200 after ``hold`` seconds; counts the requests it holds at once (the server is threaded)."""

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.active = 0
        self.peak = 0
        self.spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def __call__(self, request: Received) -> Reply:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        began = time.monotonic()
        time.sleep(self.hold)
        with self._lock:
            self.active -= 1
            self.spans.append((began, time.monotonic()))
        return Reply()


@pytest.fixture
def receivers(request: pytest.FixtureRequest) -> list[Receiver]:
    """Two receivers: two destinations (127.0.0.1 on two ports), each with a cap of its own."""
    started = []
    for _ in range(2):
        served = serve(Receiver())
        started.append(next(served))
        request.addfinalizer(lambda s=served: next(s, None))
    return started


def drain(engine: Engine, urls: list[str], per_url: int, **options: Any) -> None:
    ob = Outbox(default_backoff=Backoff(base=0.01, cap=0.05))
    handler = WebhookHandler(None, SECRET, allowed_networks=LOCAL, timeout=10, **options)
    ob.route("order.paid", handler, name="partner", max_attempts=1, timeout=30)
    factory = sessionmaker(engine)
    ob.install(factory)
    with factory() as s, s.begin():
        for n in range(per_url):
            for url in urls:
                emit(s, "order.paid", {"url": url, "n": n})
    count = per_url * len(urls)
    result = Relay(ob, engine, concurrency=count, poll_interval=0.05).run_until_idle()
    assert result.delivered == count, result


@pytest.mark.parametrize("cap", [3, None], ids=["capped", "uncapped"])
def test_a_busy_relay_opens_no_more_requests_to_a_host_than_the_cap_and_sends_everything_once(
    engine, receivers, cap
):
    receiver = receivers[0]
    holding = receiver.default = Holding(0.1)
    drain(engine, [receiver.url()], 24, max_connections=cap)

    assert len(receiver.requests) == 24
    if cap is None:
        assert holding.peak > 3  # the control: without the cap the relay's 24 deliveries overlap
    else:
        assert holding.peak == cap
    with engine.connect() as conn:
        # Every message delivered on its one attempt: waiting for a slot used up nothing.
        assert conn.execute(select(m.c.status, m.c.attempts).distinct()).all() == [("delivered", 1)]
        assert {r.outcome for r in conn.execute(select(a.c.outcome))} == {"delivered"}


def test_the_cap_is_per_host_so_one_full_host_does_not_hold_back_another(engine, receivers):
    holdings = [Holding(0.2), Holding(0.2)]
    for receiver, holding in zip(receivers, holdings, strict=True):
        receiver.default = holding
    drain(engine, [r.url() for r in receivers], 3, max_connections=1)

    assert [h.peak for h in holdings] == [1, 1]
    assert [len(r.requests) for r in receivers] == [3, 3]
    first, second = holdings[0].spans, holdings[1].spans
    # Each host got one request at a time, and the two hosts were served at the same time.
    assert any(b0 < e1 and b1 < e0 for b0, e0 in first for b1, e1 in second)


def test_a_delivery_that_finds_every_connection_busy_is_rescheduled_without_using_an_attempt(receivers):
    receiver = receivers[0]
    receiver.default = Holding(1.0)
    # timeout=0.4: a delivery waits at most 0.2 s (half the timeout) for a connection.
    handler = WebhookHandler(
        receiver.url(), SECRET, allowed_networks=LOCAL, timeout=0.4, max_connections=1, breaker_threshold=2
    )

    async def two_at_once() -> list[Any]:
        try:
            return await asyncio.gather(
                handler(message({"n": 1}, id=1)), handler(message({"n": 2}, id=2)), return_exceptions=True
            )
        finally:
            await handler.outbox_shutdown()

    results = asyncio.run(two_at_once())

    deferred = [r for r in results if isinstance(r, RetryLater)]
    assert len(deferred) == 2  # one timed out waiting for the receiver, one never got a connection
    busy = [r for r in deferred if (r.detail or {}).get("reason") == "connections_busy"]
    assert len(busy) == 1
    assert not busy[0].counts_as_attempt and busy[0].delay == 1.0
    assert busy[0].detail == {
        "reason": "connections_busy",
        "host": f"127.0.0.1:{receiver.port}",
        "destination": f"127.0.0.1:{receiver.port}",
        "max_connections": 1,
    }
    assert len(receiver.requests) == 1  # the deferred one sent nothing
    # Waiting for a connection says nothing about the host's health: only the timeout counts,
    # and one failure of the two the breaker allows leaves it closed.
    assert handler.breaker.states() == {f"127.0.0.1:{receiver.port}": False}


def test_spellings_of_one_host_share_its_cap(receivers):
    """127.0.0.1 and [::ffff:127.0.0.1] are one receiver: a second spelling gets no second connection."""
    receiver = receivers[0]
    receiver.default = Holding(4.0)
    # timeout=3: the first delivery holds the one connection for 3 s, the second waits 1.5 s for it
    # (half the timeout); wide margins, so a loaded machine does not change who gets it.
    handler = WebhookHandler(None, SECRET, allowed_networks=LOCAL, timeout=3.0, max_connections=1)
    urls = [f"http://127.0.0.1:{receiver.port}/a", f"http://[::ffff:127.0.0.1]:{receiver.port}/b"]

    async def both_at_once() -> list[Any]:
        try:
            return await asyncio.gather(
                *(handler(message({"url": url}, id=n)) for n, url in enumerate(urls)), return_exceptions=True
            )
        finally:
            await handler.outbox_shutdown()

    results = asyncio.run(both_at_once())

    busy = [
        r
        for r in results
        if isinstance(r, RetryLater) and (r.detail or {}).get("reason") == "connections_busy"
    ]
    assert len(busy) == 1, results
    assert busy[0].detail is not None and busy[0].detail["destination"] == f"127.0.0.1:{receiver.port}"
    assert len(receiver.requests) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
def test_a_bad_max_connections_is_refused_at_construction(bad):
    with pytest.raises(ConfigurationError, match="max_connections must be an integer >= 1 or None"):
        WebhookHandler("https://hooks.example.test/in", SECRET, max_connections=bad)
