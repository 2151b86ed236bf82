"""The RabbitMQ publisher against the real broker on 127.0.0.1:5672, through the real relay.

Each test declares an exchange and queues of its own (unique names, deleted
afterwards) and reads what arrived with a plain aio-pika consumer. Faults are
real too: the broker's memory alarm blocks publishers, ``rabbitmqctl`` closes
the relay's connection, a relay process is SIGKILLed between publish and record.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from relayproc import RelayProcess, wait_until
from sqlalchemy import create_engine, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker
from tcpforward import Forwarder

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, emit, ops
from outbox.integrations.rabbitmq import RabbitMQPublisher
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt

BROKER = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
SLOW = Backoff(base=60, cap=60)  # one failed attempt, then the test decides when the next one is due
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

# Every test that talks to the broker runs on one xdist worker, one at a time (the suite
# distributes with --dist loadgroup): the memory alarm below blocks every publisher on the
# broker while it lasts, and no other broker test may be running then.
pytestmark = pytest.mark.xdist_group("rabbitmq")


# -- the broker side ------------------------------------------------------------------------


@dataclass
class Arrived:
    headers: dict[str, Any]
    body: Any
    message_id: str | None
    content_type: str | None
    delivery_mode: int
    routing_key: str | None
    timestamp: Any


class Broker:
    """An exchange of this test's own, queues bound to it, and a consumer that drains them."""

    def __init__(self) -> None:
        self.exchange = f"outbox-test-{uuid.uuid4().hex[:12]}"
        self.queues: list[str] = []

    def run(self, coro: Any) -> Any:
        return asyncio.run(coro)

    async def _channel(self) -> tuple[aio_pika.abc.AbstractConnection, aio_pika.abc.AbstractChannel]:
        connection = await aio_pika.connect(BROKER)
        return connection, await connection.channel()

    def declare(self) -> None:
        async def go() -> None:
            connection, channel = await self._channel()
            async with connection:
                await channel.declare_exchange(self.exchange, aio_pika.ExchangeType.TOPIC)

        self.run(go())

    def bind(self, pattern: str, **arguments: Any) -> str:
        name = f"{self.exchange}-q{len(self.queues)}"
        self.queues.append(name)

        async def go() -> None:
            connection, channel = await self._channel()
            async with connection:
                queue = await channel.declare_queue(name, arguments=arguments or None)
                await queue.bind(self.exchange, pattern)

        self.run(go())
        return name

    def drain(self, queue: str | None = None) -> list[Arrived]:
        """Everything waiting in the queue (the first one by default), in arrival order."""

        async def go() -> list[Arrived]:
            found: list[Arrived] = []
            connection, channel = await self._channel()
            async with connection:
                q = await channel.get_queue(queue or self.queues[0])
                while (got := await q.get(no_ack=True, fail=False)) is not None:
                    found.append(
                        Arrived(
                            dict(got.headers),
                            json.loads(got.body),
                            got.message_id,
                            got.content_type,
                            int(got.delivery_mode or 0),
                            got.routing_key,
                            got.timestamp,
                        )
                    )
            return found

        return self.run(go())

    def purge(self, queue: str) -> None:
        async def go() -> None:
            connection, channel = await self._channel()
            async with connection:
                await (await channel.get_queue(queue)).purge()

        self.run(go())

    def delete(self) -> None:
        async def go() -> None:
            connection, channel = await self._channel()
            async with connection:
                for name in self.queues:
                    await channel.queue_delete(name)
                await channel.exchange_delete(self.exchange)

        self.run(go())


@pytest.fixture(scope="session")
def reachable() -> None:
    """No broker is a failure, never a skip: a skipped broker test would pass without testing anything."""

    async def probe() -> None:
        connection = await aio_pika.connect(BROKER, timeout=5)
        await connection.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        pytest.fail(f"RabbitMQ at {BROKER} does not answer (set OUTBOX_TEST_RABBITMQ_URL): {exc}")


@pytest.fixture
def broker(reachable: None) -> Iterator[Broker]:
    b = Broker()
    b.declare()
    yield b
    b.delete()


def rabbitmqctl(*args: str) -> str:
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("this fault needs rabbitmqctl on the PATH (and the broker on this machine)")
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def publisher_connections(exchange: str) -> list[str]:
    """Pids of the publisher's connections to ``exchange`` (it names them after the exchange)."""
    listing = rabbitmqctl("list_connections", "--no-table-headers", "-q", "pid", "client_properties")
    return [line.split("\t", 1)[0] for line in listing.splitlines() if f"publisher to {exchange}" in line]


# -- the outbox side -------------------------------------------------------------------------


def drain(ob: Outbox, engine: Engine) -> None:
    """Run the relay until nothing is pending any more or only far-off retries are."""
    for _ in range(200):
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            pending = conn.execute(
                select(m.c.available_at, m.c.updated_at).where(m.c.status == "pending")
            ).all()
        if all((r.available_at - r.updated_at).total_seconds() > 0.2 for r in pending):
            return
        time.sleep(0.005)
    raise AssertionError("the relay never went idle")


def make_due(engine: Engine) -> None:
    """Skip a retry's wait (the retry itself was asserted) instead of sleeping through it."""
    with engine.begin() as conn:
        conn.execute(update(m).where(m.c.status == "pending").values(available_at=m.c.created_at))


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


# -- delivery --------------------------------------------------------------------------------


def test_each_message_arrives_once_with_the_cloudevents_envelope(engine, ob, maker, broker):
    broker.bind("order.*")
    ob.route("order.paid", RabbitMQPublisher(BROKER, broker.exchange), name="orders_rabbit")
    with maker() as s, s.begin():
        for n in range(25):
            emit(s, "order.paid", {"n": n, "note": "café"}, headers={"traceparent": TRACEPARENT})
    drain(ob, engine)

    stored = {str(r.event_id): r for r in rows(engine)}
    assert {r.status for r in stored.values()} == {"delivered"}
    arrived = broker.drain()
    assert Counter(x.headers["ce-id"] for x in arrived) == Counter(stored.keys())  # each exactly once
    for x in arrived:
        row = stored[x.headers["ce-id"]]
        assert x.body == row.payload
        assert x.message_id == x.headers["ce-id"]
        assert x.content_type == "application/json"
        assert x.delivery_mode == 2  # persistent
        assert x.routing_key == "order.paid"
        assert x.headers["ce-specversion"] == "1.0"
        assert x.headers["ce-type"] == "order.paid"
        assert x.headers["ce-source"] == "urn:sqlalchemy-outbox:orders_rabbit"
        assert x.headers["traceparent"] == TRACEPARENT
        assert x.headers["ce-time"].startswith(row.created_at.strftime("%Y-%m-%dT%H:%M:%S"))
        assert int(x.timestamp.timestamp()) == int(row.created_at.timestamp())
    for attempt in history(engine):
        assert attempt.outcome == "delivered"
        assert attempt.detail["exchange"] == broker.exchange
        assert attempt.detail["routing_key"] == "order.paid"


def test_same_group_arrives_in_emit_order(engine, ob, maker, broker):
    broker.bind("#")
    ob.route("order.paid", RabbitMQPublisher(BROKER, broker.exchange), name="orders_rabbit")
    groups = ("a", "b", "c")
    for n in range(30):  # one transaction each: emit order is commit order
        with maker() as s, s.begin():
            emit(s, "order.paid", {"n": n, "group": groups[n % 3]}, group_key=f"order:{groups[n % 3]}")
    drain(ob, engine)

    arrived = broker.drain()
    assert len(arrived) == 30
    for group in groups:
        seen = [x.body["n"] for x in arrived if x.body["group"] == group]
        assert seen == sorted(seen) and len(seen) == 10


def test_the_guides_wildcard_route_publishes_every_order_event_under_its_own_routing_key(
    engine, ob, maker, broker
):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "brokers.md").read_text()
    (example,) = [block for block in re.findall(r"```python\n(.*?)```", guide, re.S) if '"order.*",' in block]
    assert '"amqp://orders:secret@rabbit.internal/prod"' in example and 'exchange="orders"' in example
    broker.bind("orders.#")
    runnable = example.replace('"amqp://orders:secret@rabbit.internal/prod"', repr(BROKER)).replace(
        'exchange="orders"', f"exchange={broker.exchange!r}"
    )
    exec(compile(runnable, "brokers.md", "exec"), {"ob": ob})
    with maker() as s, s.begin():
        emit(s, "order.placed", {"n": 1})
        emit(s, "order.paid", {"n": 2})
        with pytest.raises(outbox.UnroutedEvent, match=r"Patterns: order\.\*"):
            emit(s, "order.paid.late", {"n": 3})
    drain(ob, engine)

    arrived = broker.drain()
    assert sorted((x.body["n"], x.routing_key, x.headers["ce-type"]) for x in arrived) == [
        (1, "orders.order.placed", "order.placed"),
        (2, "orders.order.paid", "order.paid"),
    ]
    assert {r.status for r in rows(engine)} == {"delivered"}


def test_unroutable_is_dead_with_the_reason_and_a_requeued_copy_keeps_its_ce_id(engine, ob, maker, broker):
    broker.bind("order.*")
    ob.route("invoice.sent", RabbitMQPublisher(BROKER, broker.exchange), name="invoices_rabbit")
    with maker() as s, s.begin():
        emit(s, "invoice.sent", {"invoice": 9})
    drain(ob, engine)

    (row,) = rows(engine)
    assert row.status == "dead" and row.attempts == 1  # never retried: no queue will appear by itself
    (attempt,) = history(engine)
    assert attempt.outcome == "dead"
    assert attempt.error.startswith("unroutable: ")
    assert "'invoice.sent'" in attempt.error and "NO_ROUTE" in attempt.error
    assert attempt.detail["reason"] == "unroutable"
    assert broker.drain() == []

    invoices = broker.bind("invoice.*")
    ((old, new),) = ops.requeue(
        engine, ops.MessageFilter(ids=[row.id]), reason="queue bound now", actor="test"
    )
    drain(ob, engine)
    (arrived,) = broker.drain(invoices)
    assert arrived.headers["ce-id"] == str(row.event_id)
    assert [r.status for r in rows(engine)] == ["dead", "delivered"]


def test_one_publisher_in_two_routes_records_each_routes_own_outcome(engine, ob, maker, broker):
    """Both routes publish each event with its ce-id as message_id; a return must reach its own publish."""
    only_second = broker.bind("second.order.paid")
    publisher = RabbitMQPublisher(BROKER, broker.exchange, routing_key="{handler}.{event_type}")
    ob.route("order.paid", publisher, name="first")
    ob.route("order.paid", publisher, name="second")
    with maker() as s, s.begin():
        for n in range(40):
            emit(s, "order.paid", {"n": n})
    drain(ob, engine)

    outcomes = Counter((r.handler, r.status) for r in rows(engine))
    assert outcomes == Counter({("first", "dead"): 40, ("second", "delivered"): 40})
    arrived = broker.drain(only_second)
    assert sorted(x.body["n"] for x in arrived) == list(range(40))
    assert {x.routing_key for x in arrived} == {"second.order.paid"}


class Batches(RabbitMQPublisher):
    """The real publisher, noting how many messages each batch the relay hands it holds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        self.sizes.append(len(messages))
        return await super().outbox_deliver_batch(messages)


def test_a_claim_is_published_as_one_batch_with_one_history_row_per_message(engine, ob, maker, broker):
    queue = broker.bind("#")
    publisher = Batches(BROKER, broker.exchange)
    ob.route("order.paid", publisher, name="orders_rabbit")
    with maker() as s, s.begin():
        for n in range(30):
            emit(s, "order.paid", {"n": n})

    Relay(ob, engine, concurrency=50).run_until_idle()

    assert publisher.sizes == [30]
    assert sorted(x.body["n"] for x in broker.drain(queue)) == list(range(30))
    assert [(h.attempt, h.outcome, h.detail["routing_key"]) for h in history(engine)] == [
        (1, "delivered", "order.paid")
    ] * 30


def test_in_one_batch_an_unroutable_and_an_unfillable_message_fail_alone(engine, ob, maker, broker):
    """Two messages of the batch share a ce-id (message_id): the return must reach the right one."""
    queue = broker.bind("orders.paid")
    publisher = Batches(BROKER, broker.exchange, routing_key="{aggregate_type}.paid")
    ob.route("order.paid", publisher, name="orders_rabbit")
    with maker() as s, s.begin():
        for n in range(6):
            emit(s, "order.paid", {"n": n})
    kinds = {0: "orders", 1: "nobody", 2: "orders", 3: None, 4: "orders", 5: "orders"}
    with engine.begin() as conn:
        ids = {r.payload["n"]: r for r in conn.execute(select(m.c.id, m.c.payload, m.c.event_id))}
        for n, kind in kinds.items():
            conn.execute(update(m).where(m.c.id == ids[n].id).values(aggregate_type=kind))
        # The unroutable message's event id on a routable one too: one AMQP message_id, two publishes.
        conn.execute(update(m).where(m.c.id == ids[2].id).values(event_id=ids[1].event_id))

    Relay(ob, engine).run_until_idle()

    assert publisher.sizes == [6]
    state = {r.payload["n"]: (r.status, r.attempts) for r in rows(engine)}
    assert state == {
        0: ("delivered", 1),
        1: ("dead", 1),
        2: ("delivered", 1),
        3: ("dead", 1),
        4: ("delivered", 1),
        5: ("delivered", 1),
    }
    by_id = {h.message_id: h for h in history(engine)}
    assert len(by_id) == 6
    unroutable, unfillable = by_id[ids[1].id], by_id[ids[3].id]
    assert unroutable.detail["reason"] == "unroutable" and "'nobody.paid'" in unroutable.error
    assert "needs aggregate_type" in unfillable.error
    arrived = broker.drain(queue)
    assert sorted(x.body["n"] for x in arrived) == [0, 2, 4, 5]
    assert [x.message_id for x in arrived if x.body["n"] == 2] == [str(ids[1].event_id)]


def test_unroutable_can_be_retried_until_a_queue_is_bound(engine, ob, maker, broker):
    """Day one: consumers declare their queues when they start, perhaps after the first event."""
    publisher = RabbitMQPublisher(BROKER, broker.exchange, on_unroutable="retry")
    ob.route("order.paid", publisher, name="orders_rabbit", backoff=SLOW)
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    drain(ob, engine)
    (row,) = rows(engine)
    assert (row.status, row.attempts) == ("pending", 1)  # a counted attempt: max_attempts still bounds it
    (attempt,) = history(engine)
    assert attempt.outcome == "retry" and attempt.detail["reason"] == "unroutable"

    queue = broker.bind("order.*")
    make_due(engine)
    drain(ob, engine)
    assert rows(engine)[0].status == "delivered"
    assert [x.body for x in broker.drain(queue)] == [{"n": 1}]


def test_a_broker_outage_uses_up_no_attempts(engine, ob, maker, broker):
    """Refused connections and a connection reset mid-run defer, uncounted, however long they last."""
    queue = broker.bind("#")
    with Forwarder(5672) as path:
        url = f"amqp://guest:guest@127.0.0.1:{path.port}/"
        ob.route(
            "order.paid",
            RabbitMQPublisher(url, broker.exchange, publish_timeout=2.0),
            name="rabbit",
            max_attempts=2,
        )
        with maker() as s, s.begin():
            emit(s, "order.paid", {"n": 0})
        drain(ob, engine)  # connected through the forwarder: delivered
        path.cut()
        with maker() as s, s.begin():
            for n in range(1, 6):
                emit(s, "order.paid", {"n": n})
        for _ in range(3):  # three rounds of the outage: more than max_attempts
            Relay(ob, engine).run_until_idle()
            make_due(engine)
        waiting = [r for r in rows(engine) if r.status != "delivered"]
        assert {(r.status, r.attempts) for r in waiting} == {("pending", 0)}
        deferrals = [h for h in history(engine) if h.outcome == "retry"]
        assert len(deferrals) == 15
        assert all(h.detail["counted"] is False and h.detail["reason"] == "connection" for h in deferrals)
        assert all("guest:guest" not in h.error and "not counted" in h.error for h in deferrals)

        path.restore()
        make_due(engine)
        drain(ob, engine)
    assert {(r.status, r.attempts) for r in rows(engine)} == {("delivered", 1)}
    assert sorted(x.body["n"] for x in broker.drain(queue)) == list(range(6))


def test_a_full_queue_that_rejects_publishes_is_retried_until_there_is_room(engine, ob, maker, broker):
    queue = broker.bind("#", **{"x-max-length": 1, "x-overflow": "reject-publish"})
    ob.route("order.paid", RabbitMQPublisher(BROKER, broker.exchange), name="orders_rabbit", backoff=SLOW)
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    drain(ob, engine)
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 2})
    Relay(ob, engine).run_until_idle()

    second = rows(engine)[1]
    assert second.status == "pending"
    nacked = [h for h in history(engine) if h.message_id == second.id]
    assert nacked[0].outcome == "retry" and nacked[0].detail["reason"] == "nacked"
    assert "refused" in nacked[0].error

    assert [x.body["n"] for x in broker.drain(queue)] == [1]  # room again
    make_due(engine)
    drain(ob, engine)
    assert rows(engine)[1].status == "delivered"
    assert [x.body["n"] for x in broker.drain(queue)] == [2]


ALARM = "0.0000001"  # a watermark no broker is under: the memory alarm goes off at once
WATERMARK = "vm_memory_monitor:get_vm_memory_high_watermark()."
CONFIGURED = "application:get_env(rabbit, vm_memory_high_watermark)."


def watermark_args(term: str) -> list[str] | None:
    """``set_vm_memory_high_watermark``'s arguments for an Erlang watermark; None for ours or none."""
    term = term.strip()
    if term.startswith("{ok,"):  # application:get_env's answer
        term = term.removeprefix("{ok,").removesuffix("}")
    absolute = re.fullmatch(r'\{absolute,\s*"?([^"}]+)"?\}', term)
    if absolute:
        return ["absolute", absolute.group(1)]
    try:
        fraction = float(term)
    except ValueError:
        return None
    return None if fraction <= float(ALARM) * 10 else [term]


class _Interrupted(KeyboardInterrupt):
    """SIGTERM turned into an exception, so the watermark is restored on the way out."""


def _interrupt(signum: int, frame: Any) -> None:
    raise _Interrupted(f"signal {signum}")


@pytest.fixture
def memory_alarm() -> Iterator[Callable[[], AbstractContextManager[None]]]:
    """The broker's memory alarm for the length of a ``with`` block: it blocks every publisher on the broker.

    The broker's previous watermark comes back when the block ends however it ends: a failure,
    Ctrl-C or SIGTERM (made an exception while the fixture lives). Only a run killed outright
    leaves the alarm raised; the next run then restores the configured watermark, not that one.
    """
    restore = watermark_args(rabbitmqctl("eval", WATERMARK))
    if restore is None:  # an earlier run's alarm is still raised (or the answer is unreadable)
        restore = watermark_args(rabbitmqctl("eval", CONFIGURED)) or ["0.4"]  # 0.4: RabbitMQ's default
    raised = False

    def lift() -> None:
        nonlocal raised
        rabbitmqctl("set_vm_memory_high_watermark", *restore)
        raised = False

    @contextmanager
    def alarm() -> Iterator[None]:
        nonlocal raised
        raised = True
        try:
            rabbitmqctl("set_vm_memory_high_watermark", ALARM)
            yield
        finally:
            lift()

    main = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        yield alarm
    finally:
        try:
            if raised:
                lift()
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous_handler or signal.SIG_DFL)


def test_a_confirm_that_never_comes_is_a_retry_not_a_hang(engine, ob, maker, broker, memory_alarm):
    broker.bind("#")
    publisher = RabbitMQPublisher(BROKER, broker.exchange, publish_timeout=1.0)
    ob.route("order.paid", publisher, name="orders_rabbit", backoff=SLOW)
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    with memory_alarm():
        began = time.monotonic()
        Relay(ob, engine).run_until_idle()
        took = time.monotonic() - began
    assert took < 8, f"the relay waited {took:.1f}s on a blocked broker"
    (row,) = rows(engine)
    assert row.status == "pending"
    attempt = history(engine)[0]
    assert attempt.outcome == "retry" and attempt.detail["reason"] == "timeout"
    assert "no confirm" in attempt.error and "guest:guest" not in attempt.error

    make_due(engine)
    drain(ob, engine)
    assert rows(engine)[0].status == "delivered"
    arrived = broker.drain()
    # The blocked publish may still land once the broker unblocks: at least once, same ce-id.
    assert 1 <= len(arrived) <= len(history(engine))
    assert {x.headers["ce-id"] for x in arrived} == {str(row.event_id)}


# -- relay processes -------------------------------------------------------------------------


def relay(pg_url: str, tmp_path: Path, name: str, exchange: str, *args: str, **env: str) -> RelayProcess:
    return RelayProcess(
        pg_url,
        ["--app", "rabbit_app:ob", "--poll-interval", "0.2", *args],  # the last --app wins
        log_path=tmp_path / f"{name}.log",
        env={"RABBIT_URL": BROKER, "RABBIT_EXCHANGE": exchange, **env},
    )


def emit_many(pg_url: str, count: int) -> list[str]:
    engine = create_engine(pg_url)
    ob = Outbox()
    ob.route("order.paid", lambda msg: None, name="rabbit")  # the app's route name, for emit
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with factory() as s, s.begin():
            for n in range(count):
                emit(s, "order.paid", {"n": n})
        with engine.connect() as conn:
            return [str(e) for e in conn.scalars(select(m.c.event_id))]
    finally:
        ob.uninstall(factory)
        engine.dispose()


def delivered(pg_url: str) -> int:
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).where(m.c.status == "delivered")) or 0)
    finally:
        engine.dispose()


def test_a_broker_outage_mid_run_loses_nothing(pg_url, tmp_path, broker):
    broker.bind("#")
    events = emit_many(pg_url, 300)
    # About 80 messages a second, so the run outlasts the slow rabbitmqctl calls below.
    proc = relay(pg_url, tmp_path, "relay", broker.exchange, "--concurrency", "4", RABBIT_DELAY="0.05")
    try:
        (first,) = wait_until(lambda: publisher_connections(broker.exchange), "the publisher's connection")
        rabbitmqctl("close_connection", first, "outbox test: broker outage")
        assert delivered(pg_url) < 300, "the outage came too late to matter"
        wait_until(lambda: delivered(pg_url) == 300, "every message delivered", relays=[proc], timeout=40)
        (second,) = publisher_connections(broker.exchange)
        assert second != first  # it reconnected
    finally:
        proc.kill()
    arrived = Counter(x.headers["ce-id"] for x in broker.drain())
    assert set(arrived) == set(events)  # 0 lost
    assert all(count <= 2 for count in arrived.values())


def test_a_relay_killed_between_publish_and_record_publishes_again_with_the_same_ce_id(
    pg_url, tmp_path, broker
):
    broker.bind("#")
    events = emit_many(pg_url, 5)
    published = tmp_path / "published"
    published.mkdir()
    first = relay(
        pg_url,
        tmp_path,
        "first",
        broker.exchange,
        "--lease",
        "1",
        RABBIT_PUBLISHED_DIR=str(published),
        RABBIT_HANG_AFTER_PUBLISH="1",
    )
    try:
        wait_until(lambda: len(list(published.iterdir())) == 5, "5 confirmed publishes", relays=[first])
        assert delivered(pg_url) == 0
        first.signal(signal.SIGKILL)
        first.wait(10)
    finally:
        first.kill()
    engine = create_engine(pg_url)
    try:
        assert history(engine) == []  # the crash fell between the broker's confirm and the record
    finally:
        engine.dispose()

    second = relay(pg_url, tmp_path, "second", broker.exchange, "--lease", "1")  # recovers every 0.5 s
    try:
        wait_until(lambda: delivered(pg_url) == 5, "redelivery after the lease", relays=[second])
    finally:
        second.kill()
    engine = create_engine(pg_url)
    try:
        outcomes = Counter(h.outcome for h in history(engine))
    finally:
        engine.dispose()
    assert outcomes == Counter({"lease_expired": 5, "delivered": 5})
    arrived = broker.drain()
    counts = Counter(x.headers["ce-id"] for x in arrived)
    assert counts == Counter({event: 2 for event in events})  # at least once: each one twice here
    for x in arrived:
        assert x.message_id == x.headers["ce-id"]


# -- configuration and secrets -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"url": "http://127.0.0.1/"}, "amqp:// or amqps://"),
        ({"url": ""}, "non-empty string"),
        ({"url": "amqp:///vhost"}, "no host"),
        ({"routing_key": "{nope}"}, "is not one of"),
        ({"routing_key": ""}, "must not be empty"),
        ({"correlation_id": "{order_id}"}, "is not one of"),
        ({"publish_timeout": 0}, "publish_timeout"),
        ({"publish_timeout": float("nan")}, "publish_timeout"),
        ({"declare_exchange": "fan-out"}, "declare_exchange"),
        ({"exchange": "", "declare_exchange": "topic"}, "default exchange"),
        ({"exchange": "amq.topic", "declare_exchange": "topic"}, "reserved"),
        ({"source": ""}, "source"),
    ],
)
def test_bad_configuration_is_refused_when_built(kwargs, problem):
    args: dict[str, Any] = {"url": BROKER, "exchange": "orders", **kwargs}
    with pytest.raises(ConfigurationError, match=problem):
        RabbitMQPublisher(**args)


def test_the_password_never_shows(broker):
    url = "amqp://guest:s3cr%40t-pw@127.0.0.1:5672/"
    publisher = RabbitMQPublisher(url, broker.exchange)
    assert "s3cr" not in repr(publisher) and "***" in publisher.url
    assert {"s3cr@t-pw", "s3cr%40t-pw"} <= set(publisher.outbox_secrets())
    with pytest.raises(ConfigurationError) as refused:
        RabbitMQPublisher("http://user:s3cr3t@127.0.0.1/", broker.exchange)
    assert "s3cr3t" not in str(refused.value)

    msg = Message(id=1, event_id=uuid.uuid4(), event_type="order.paid", handler="h", payload={})

    async def attempt() -> str:
        try:
            await publisher(msg)
        except outbox.RetryLater as exc:  # wrong password: the broker refuses the login
            return str(exc)
        finally:
            await publisher.outbox_shutdown()
        raise AssertionError("published with a wrong password")

    text = asyncio.run(attempt())
    assert "ACCESS_REFUSED" in text and "s3cr" not in text and "***" in text


def test_a_missing_exchange_is_retried_with_the_reason_and_can_be_declared(broker):
    missing = f"{broker.exchange}-declared"
    msg = Message(id=1, event_id=uuid.uuid4(), event_type="order.paid", handler="h", payload={})

    async def go() -> None:
        publisher = RabbitMQPublisher(BROKER, missing)
        try:
            with pytest.raises(outbox.RetryLater, match="does not exist"):
                await publisher(msg)
        finally:
            await publisher.outbox_shutdown()
        declaring = RabbitMQPublisher(BROKER, missing, declare_exchange="topic")
        try:
            with pytest.raises(outbox.PermanentError, match="unroutable"):  # exists now, nothing bound
                await declaring(msg)
        finally:
            await declaring.outbox_shutdown()
        connection = await aio_pika.connect(BROKER)
        async with connection:
            channel = await connection.channel()
            await channel.exchange_delete(missing)

    asyncio.run(go())
