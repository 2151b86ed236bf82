"""Outages of a destination, against the real servers, with every setting at its default.

Each test runs a relay serving on PostgreSQL while an emitter keeps adding a
message every ``EMIT_EVERY`` seconds (``OUTBOX_OUTAGE_EMIT_EVERY``, 0.5), takes the destination away for
``OUTBOX_OUTAGE_SECONDS`` (15 by default, so a CI run stays short;
docs/brokers.md and docs/webhooks.md record runs of ten and two minutes),
brings it back, and checks what the product promises of an outage:

- nothing is dead, and a broker outage uses no attempt: each message's one
  counted attempt is the one that delivered it, every other history row a
  deferral marked ``counted: false``;
- the outage was met: messages were parked on the destination;
- everything is delivered within ``RECOVERY`` seconds of the destination's
  return (5 for a broker, 2 for a webhook receiver), or of its own emit if
  that came later.

Each test prints one summary line (``pytest -s`` shows it). RabbitMQ's runs
must hold ``flock /tmp/rabbit.lock`` like every test of the shared broker; the
NATS test runs a server of its own, the Kafka test librdkafka's mock cluster.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from kafkamock import MockCluster
from relayproc import wait_until
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from tcpforward import Forwarder
from test_rabbitmq import BROKER, Broker
from test_relay_registry import Serving
from test_webhook import LOCAL, SECRET

import outbox
from outbox import Outbox, emit
from outbox.integrations.kafka import KafkaPublisher
from outbox.integrations.nats import NatsPublisher
from outbox.integrations.rabbitmq import RabbitMQPublisher
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt

OUTAGE = float(os.environ.get("OUTBOX_OUTAGE_SECONDS", "15"))
EMIT_EVERY = float(os.environ.get("OUTBOX_OUTAGE_EMIT_EVERY", "0.5"))
BROKER_RECOVERY = 5.0
WEBHOOK_RECOVERY = 2.0
NATS_SERVER = "/usr/sbin/nats-server"


# -- the common course of an outage ------------------------------------------------------------


class Emitter:
    """Emits ``order.paid`` every ``EMIT_EVERY`` seconds on a thread of its own, until stopped."""

    def __init__(self, maker: sessionmaker[Session]) -> None:
        self._maker = maker
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        try:
            while not self._stop.wait(EMIT_EVERY):
                with self._maker.begin() as s:
                    emit(s, "order.paid", {"n": n})
                n += 1
        except BaseException as exc:  # the test reports it
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert self.error is None, f"the emitter failed: {self.error!r}"


@dataclass(frozen=True)
class Summary:
    messages: int
    backlog: int  # emitted before the return, delivered after it
    deferrals: int
    counted: int  # deferrals that used an attempt
    parked: int
    first_after_return: float  # seconds from the return to the first delivery of the backlog
    latest_after_return: float  # seconds: the latest delivery after the later of return and emit

    def line(self, what: str) -> str:
        return (
            f"{what}: outage {OUTAGE:g}s, {self.messages} messages, 0 dead, {self.deferrals} deferrals"
            f" ({self.parked} parked), {self.counted} counted; backlog of {self.backlog} delivered from"
            f" {self.first_after_return:.2f}s to {self.latest_after_return:.2f}s after the return;"
            f" every message within {self.latest_after_return:.2f}s of the return or of its emit"
        )


def delivered(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(m.c.status == "delivered")) or 0)


def delivered_since(engine: Engine, moment: datetime) -> int:
    with engine.connect() as conn:
        emitted_since = (m.c.status == "delivered") & (m.c.created_at > moment)
        return int(conn.scalar(select(func.count()).where(emitted_since)) or 0)


def parked_on(engine: Engine, destination: str) -> int:
    """History rows of deferrals that parked a message on ``destination``."""
    with engine.connect() as conn:
        return sum(
            1
            for detail in conn.scalars(select(a.c.detail).where(a.c.outcome == "retry"))
            if isinstance(detail, dict) and detail.get("parked_on") == destination
        )


def through_an_outage(
    ob: Outbox,
    engine: Engine,
    destination: str,
    take_away: Callable[[], None],
    bring_back: Callable[[], None],
) -> datetime:
    """Serve, emit, take the destination away for ``OUTAGE`` seconds, bring it back; when it came back."""
    maker = sessionmaker(engine)
    ob.install(maker)
    relay = Serving(Relay(ob, engine, relay_id="outage-relay"))  # every setting at its default
    emitter = Emitter(maker)
    try:
        wait_until(lambda: delivered(engine) >= 3, "deliveries before the outage", timeout=60)
        take_away()
        began = time.monotonic()
        wait_until(lambda: parked_on(engine, destination), "a message parked on the destination", timeout=60)
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - began)))  # the outage's length, not a wait for state
        returned = datetime.now(UTC)  # before: a restarted server's boot counts against it
        bring_back()
        # Messages keep coming after the return, too: they must not wait behind the backlog.
        wait_until(
            lambda: delivered_since(engine, returned) >= 2, "messages emitted after the return", timeout=60
        )
        emitter.stop()
        with engine.connect() as conn:
            total = int(conn.scalar(select(func.count()).select_from(m)) or 0)
        wait_until(lambda: delivered(engine) == total, "every message delivered", timeout=60)
    finally:
        emitter.stop()
        relay.stop()
        ob.uninstall(maker)
    return returned


def outcome(
    engine: Engine, destination: str, returned: datetime, *, counted_before_opening: int = 0
) -> Summary:
    """The promise of an outage, checked on the messages and their history; what it took."""
    with engine.connect() as conn:
        rows = conn.execute(select(m.c.id, m.c.status, m.c.attempts, m.c.created_at, m.c.delivered_at)).all()
        history = conn.execute(select(a.c.message_id, a.c.outcome, a.c.detail)).all()
    assert {r.status for r in rows} == {"delivered"}, "nothing dead, nothing left behind"
    deferrals = [h for h in history if h.outcome != "delivered"]
    counted = [h for h in deferrals if not (isinstance(h.detail, dict) and h.detail.get("counted") is False)]
    assert len(counted) <= counted_before_opening, f"attempts used by the outage: {counted[:5]}"
    assert {h.outcome for h in deferrals} <= {"retry"}
    if not counted_before_opening:
        assert {r.attempts for r in rows} == {1}, "each message's one counted attempt delivered it"
    parked = [h for h in deferrals if isinstance(h.detail, dict) and h.detail.get("parked_on") == destination]
    assert parked, "the outage was met: messages were parked on the destination"
    latest = max((r.delivered_at - max(r.created_at, returned)).total_seconds() for r in rows)
    backlog = [
        (r.delivered_at - returned).total_seconds() for r in rows if r.delivered_at > returned > r.created_at
    ]
    first = min(backlog, default=0.0)
    return Summary(len(rows), len(backlog), len(deferrals), len(counted), len(parked), first, latest)


# -- RabbitMQ: the path to the broker cut -------------------------------------------------------


@pytest.fixture
def rabbit() -> Iterator[Broker]:
    b = Broker()
    b.declare()
    yield b
    b.delete()


@pytest.mark.xdist_group("rabbitmq")  # the shared broker, behind a forwarder: see tests/test_rabbitmq.py
def test_a_rabbitmq_outage_kills_nothing_and_the_backlog_goes_within_seconds_of_the_return(pg_engine, rabbit):
    queue = rabbit.bind("#")
    with Forwarder(5672) as path:
        url = BROKER.replace("127.0.0.1:5672", f"127.0.0.1:{path.port}")
        publisher = RabbitMQPublisher(url, rabbit.exchange)
        ob = Outbox()
        ob.route("order.paid", publisher, name="orders_rabbit")
        returned = through_an_outage(ob, pg_engine, publisher.destination, path.cut, path.restore)
    summary = outcome(pg_engine, publisher.destination, returned)
    print(summary.line("RabbitMQ"))
    assert summary.latest_after_return <= BROKER_RECOVERY
    arrived = {x.body["n"] for x in rabbit.drain(queue)}
    assert arrived == set(range(summary.messages)), "every message reached the queue"


# -- NATS: a server of the test's own, stopped and started again ----------------------------------


class NatsServer:
    """``nats-server -js`` on a free port with its own store, which a test may stop and start again."""

    def __init__(self, store: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self._args = [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(store)]
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def admin(self, call: Callable[[Any], Any]) -> Any:
        async def go() -> Any:
            nc = await nats.connect(self.url, connect_timeout=2, max_reconnect_attempts=0)
            try:
                return await call(nc.jetstream())
            finally:
                await nc.close()

        return asyncio.run(go())

    def start(self) -> None:
        self._proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def ready() -> bool:
            try:
                self.admin(lambda js: js.account_info())
            except Exception:
                return False
            return True

        wait_until(ready, "nats-server with JetStream", timeout=20)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)  # a crash: no goodbye to the clients
            self._proc.wait(10)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "jetstream")
    yield server
    server.stop()


def test_a_nats_server_restarted_after_an_outage_gets_everything_within_seconds(pg_engine, nats_server):
    name = f"OUTAGE_{uuid.uuid4().hex[:8]}"
    nats_server.admin(lambda js: js.add_stream(name=name, subjects=["orders.>"], duplicate_window=600))
    publisher = NatsPublisher(nats_server.url, subject="orders.{event_type}", stream=name)
    ob = Outbox()
    ob.route("order.paid", publisher, name="orders_nats")
    returned = through_an_outage(ob, pg_engine, publisher.destination, nats_server.stop, nats_server.start)
    summary = outcome(pg_engine, publisher.destination, returned)
    print(summary.line("NATS"))
    assert summary.latest_after_return <= BROKER_RECOVERY
    stored = nats_server.admin(lambda js: js.stream_info(name)).state.messages
    assert stored == summary.messages, "each message stored once (the dedupe window drops a repeat)"


# -- Kafka: librdkafka's mock cluster, every broker down -------------------------------------------


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mc = MockCluster(brokers=3)
    mc.create_topic("orders", partitions=3)
    yield mc
    mc.close()


def test_kafka_brokers_down_then_up_lose_nothing_and_deliver_within_seconds(pg_engine, cluster):
    publisher = KafkaPublisher({"bootstrap.servers": cluster.bootstrap_servers}, topic="orders")
    ob = Outbox()
    ob.route("order.paid", publisher, name="orders_kafka")
    returned = through_an_outage(ob, pg_engine, publisher.destination, cluster.set_down, cluster.set_up)
    summary = outcome(pg_engine, publisher.destination, returned)
    print(summary.line("Kafka"))
    assert summary.latest_after_return <= BROKER_RECOVERY


# -- a webhook receiver answering 503 ---------------------------------------------------------------

#: The receiver, a process of its own as a partner's would be (asyncio, keep-alive): 503 while the flag
#: file exists, else 200. Python's http.server would be the slowest part of the test.
RECEIVER = """
import asyncio, os, sys

flag = sys.argv[1]

async def answer(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            length = 0
            for line in head.split(b"\\r\\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            down = os.path.exists(flag)
            body = b"maintenance" if down else b""
            status = b"503 Service Unavailable" if down else b"200 OK"
            size = str(len(body)).encode()
            writer.write(b"HTTP/1.1 " + status + b"\\r\\ncontent-length: " + size + b"\\r\\n\\r\\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 0, backlog=512)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


@pytest.fixture
def partner(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A receiver process on a free port, and the flag file that makes it answer 503."""
    flag = tmp_path / "down"
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(flag)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline()), flag
    finally:
        proc.kill()
        proc.wait(10)


def test_a_webhook_receiver_back_from_503_gets_everything_within_two_seconds(pg_engine, partner):
    port, flag = partner
    handler = WebhookHandler(f"http://127.0.0.1:{port}/hook", SECRET, allowed_networks=LOCAL)  # defaults
    ob = Outbox()
    ob.route("order.paid", handler, name="partner")
    destination = f"127.0.0.1:{port}"
    returned = through_an_outage(ob, pg_engine, destination, flag.touch, flag.unlink)
    # The failures that open the breaker count, as any failure of a destination that looked up;
    # none after it opened did.
    summary = outcome(pg_engine, destination, returned, counted_before_opening=handler.breaker.threshold - 1)
    print(summary.line("webhook"))
    assert summary.latest_after_return <= WEBHOOK_RECOVERY
