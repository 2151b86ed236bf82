"""RabbitMQConsumer against the real broker on 127.0.0.1:5672: each effect once, acked after its commit.

Each test makes queues (and exchanges) of its own, with unique names, and
deletes them afterwards. Messages are published by our own publisher
(``RabbitMQPublisher``, through the relay or its batch call), except the
broken ones a foreign producer would send. Outages are a ``tcpforward``
forwarder in front of the shared broker, cut and restored (the broker itself
is never stopped); the consumer's URL then asks for one-second heartbeats,
so a connection that went silent is noticed within two.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import httpx
import pytest
from relayproc import relay_env, wait_until
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from tcpforward import Forwarder

from outbox import (
    Backoff,
    ConfigurationError,
    Inbox,
    InboxMessage,
    Message,
    Outbox,
    emit,
    outbox_inbox,
    outbox_inbox_dead,
    outbox_message,
)
from outbox.consumer import Consumer, ConsumerMetrics
from outbox.integrations.rabbitmq import QueueDeclaration, RabbitMQConsumer, RabbitMQPublisher
from outbox.relay import Relay

BROKER = os.environ.get("OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
KILL_MESSAGES = int(os.environ.get("OUTBOX_INBOX_KILL_MESSAGES") or 10_000)
FAULTS = 8  # the fault test's consumer runs that end in a SIGKILL

# The shared broker: these tests run on one xdist worker, one at a time (see tests/test_rabbitmq.py).
pytestmark = pytest.mark.xdist_group("rabbitmq")

tables = MetaData()
effects = Table(
    "effects",  # no unique constraint: a second effect of one message shows as a second row
    tables,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", String(255), nullable=False),
    Column("pid", Integer),
)


class FixedDelay(Backoff):
    """Every redelivery waits exactly ``base`` seconds: a test can tell "after the delay" apart."""

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return self.base


def through(port: int, **query: str) -> str:
    """BROKER's credentials and vhost, at 127.0.0.1:``port`` (a forwarder), with one-second heartbeats."""
    url = re.sub(r"@[^/]+/", f"@127.0.0.1:{port}/", BROKER)
    return (
        url
        + ("&" if "?" in url else "?")
        + "&".join(f"{k}={v}" for k, v in {"heartbeat": "1", **query}.items())
    )


# -- the broker side ------------------------------------------------------------------------------


class Rabbit:
    """This test's queues and exchanges on the shared broker (deleted afterwards), and raw publishes."""

    def __init__(self) -> None:
        self.prefix = f"outbox-inbox-{uuid.uuid4().hex[:10]}"
        self.queues: list[str] = []
        self.exchanges: list[str] = []

    def queue_name(self, suffix: str = "q") -> str:
        name = f"{self.prefix}-{suffix}"
        self.queues.append(name)
        return name

    def exchange_name(self, suffix: str = "x") -> str:
        name = f"{self.prefix}-{suffix}"
        self.exchanges.append(name)
        return name

    @staticmethod
    def run(work: Callable[[aio_pika.abc.AbstractChannel], Any]) -> Any:
        async def go() -> Any:
            connection = await aio_pika.connect(BROKER, timeout=10)
            async with connection:
                return await work(await connection.channel())

        return asyncio.run(go())

    def declare(self, suffix: str = "q", *, queue_type: str = "classic") -> str:
        name = self.queue_name(suffix)

        async def work(channel: aio_pika.abc.AbstractChannel) -> None:
            await channel.declare_queue(name, durable=True, arguments={"x-queue-type": queue_type})

        self.run(work)
        return name

    def depth(self, queue: str) -> int:
        """Messages ready in ``queue`` (an unacknowledged one is not counted until it is given back)."""

        async def work(channel: aio_pika.abc.AbstractChannel) -> int:
            declared = await channel.declare_queue(queue, passive=True)
            return int(declared.declaration_result.message_count or 0)

        return int(self.run(work))

    def delete_queue(self, queue: str) -> None:
        async def work(channel: aio_pika.abc.AbstractChannel) -> None:
            await channel.queue_delete(queue)

        self.run(work)

    def publish_raw(
        self, queue: str, body: bytes, headers: dict[str, Any] | None = None, message_id: str | None = None
    ) -> None:
        """What a producer that is not ours might send: straight to ``queue``, envelope or not."""

        async def work(channel: aio_pika.abc.AbstractChannel) -> None:
            message = aio_pika.Message(body, headers=headers or {}, message_id=message_id)
            await channel.default_exchange.publish(message, queue)

        self.run(work)

    def publish_bare(self, queue: str, body: bytes, headers: dict[str, str]) -> None:
        """A message with no AMQP message_id: published by the broker itself, since aio-pika adds one."""
        if shutil.which("rabbitmqctl") is None:
            pytest.fail("this test needs rabbitmqctl on the PATH (and the broker on this machine)")
        vhost = urlsplit(BROKER).path.removeprefix("/") or "/"
        fields = ", ".join(f'{{<<"{name}">>, longstr, <<"{value}">>}}' for name, value in headers.items())
        expr = (
            f'rabbit_basic:publish(rabbit_misc:r(<<"{vhost}">>, exchange, <<"">>), <<"{queue}">>, '
            f'[{{headers, [{fields}]}}], <<"{body.decode()}">>).'
        )
        subprocess.run(["rabbitmqctl", "eval", expr], capture_output=True, timeout=60, check=True)

    def cleanup(self) -> None:
        async def work(channel: aio_pika.abc.AbstractChannel) -> None:
            for name in self.queues:
                await channel.queue_delete(name)
            for name in self.exchanges:
                await channel.exchange_delete(name)

        self.run(work)


@pytest.fixture(scope="session")
def reachable() -> None:
    """No broker is a failure, never a skip."""
    try:
        Rabbit.run(lambda channel: asyncio.sleep(0))
    except Exception as exc:
        pytest.fail(f"RabbitMQ at {BROKER} does not answer (set OUTBOX_TEST_RABBITMQ_URL): {exc}")


@pytest.fixture
def rabbit(reachable: None) -> Iterator[Rabbit]:
    r = Rabbit()
    yield r
    r.cleanup()


def event(
    n: int, *, event_id: uuid.UUID | None = None, event_type: str = "order.paid", **payload: Any
) -> Message:
    return Message(
        id=n,
        event_id=event_id or uuid.uuid4(),
        event_type=event_type,
        handler="orders",
        payload={"n": n, **payload},
        created_at=datetime.now(UTC),
    )


def publish(exchange: str, routing_key: str, messages: list[Message], *, batch: int = 1000) -> None:
    """Publish with our own publisher (its batch call, as the relay makes it); every one confirmed."""

    async def go() -> None:
        publisher = RabbitMQPublisher(BROKER, exchange, routing_key)
        try:
            for start in range(0, len(messages), batch):
                outcomes = await publisher.outbox_deliver_batch(messages[start : start + batch])
                failed = [o for o in outcomes if isinstance(o, Exception)]
                assert not failed, failed[:3]
        finally:
            await publisher.outbox_shutdown()

    asyncio.run(go())


# -- the consuming side ---------------------------------------------------------------------------


@pytest.fixture
def db(database_url: str) -> Iterator[tuple[str, Engine]]:
    engine = create_engine(database_url)
    tables.create_all(engine)
    yield database_url, engine
    engine.dispose()


@pytest.fixture
def pg_db(pg_url: str) -> Iterator[tuple[str, Engine]]:
    engine = create_engine(pg_url)
    tables.create_all(engine)
    yield pg_url, engine
    engine.dispose()


def recording(
    inbox: Inbox, *, slow: threading.Event | None = None, started: threading.Event | None = None
) -> None:
    """Each message's effect: a row in ``effects``; one with ``"slow": true`` waits for ``slow``."""

    @inbox.handler("#", name="effect")
    def effect(session: Session, message: InboxMessage) -> None:
        if slow is not None and isinstance(message.payload, dict) and message.payload.get("slow"):
            assert started is not None
            started.set()
            slow.wait(60)
        session.execute(effects.insert().values(message_id=message.id, pid=os.getpid()))


def effect_counts(engine: Engine) -> Counter[str]:
    with engine.connect() as conn:
        return Counter(conn.scalars(select(effects.c.message_id)).all())


def markers(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(select(outbox_inbox.c.message_id, outbox_inbox.c.outcome, outbox_inbox.c.source))
        return {row.message_id: row for row in rows}


def dead_letters(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(outbox_inbox_dead).order_by(outbox_inbox_dead.c.id)))


def counted(metrics: ConsumerMetrics, outcome: str) -> float:
    return sum(
        sample.value
        for family in metrics.messages.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") == outcome
    )


@contextmanager
def serving(consumer: Consumer) -> Iterator[list[BaseException]]:
    """Run ``consumer`` in a thread for the block; stop it (gracefully) and wait for it after."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    thread = threading.Thread(target=run, name="consumer")
    thread.start()
    try:
        yield errors
    finally:
        if thread.is_alive():
            wait_until(lambda: consumer._loop is not None, "the consumer's loop", timeout=30)
            consumer.stop()
        thread.join(60)
    assert not thread.is_alive(), "the consumer did not stop"
    if errors:
        raise errors[0]


def ready(metrics: ConsumerMetrics, errors: list[BaseException]) -> Callable[[], bool]:
    """Ready, and its source has said it is connected (readiness alone is true before it has tried)."""

    def check() -> bool:
        assert not errors, errors
        up = [sample.value for family in metrics.source_up.collect() for sample in family.samples]
        return metrics.ready()[0] and up == [1]

    return check


class AckWatch:
    """Wraps a source so that each acknowledgement first checks the message's marker is committed."""

    def __init__(self, source: RabbitMQConsumer, engine: Engine, consumer: str) -> None:
        self._source = source
        self._engine = engine
        self._consumer = consumer
        self.acked: list[tuple[str, bool]] = []

    @property
    def name(self) -> str:
        return self._source.name

    async def consume(self, context: Any) -> None:
        watch = self

        class Watched:
            def __getattr__(self, name: str) -> Any:
                return getattr(context, name)

            async def take(self, message: InboxMessage, *, ack: Any = None, before_commit: Any = None) -> Any:
                async def checked() -> None:
                    with watch._engine.connect() as conn:
                        committed = conn.scalar(
                            select(func.count())
                            .select_from(outbox_inbox)
                            .where(outbox_inbox.c.consumer == watch._consumer)
                            .where(outbox_inbox.c.message_id == message.id)
                        )
                    watch.acked.append((message.id, committed == 1))
                    await ack()

                return await context.take(message, ack=checked, before_commit=before_commit)

        await self._source.consume(Watched())


# -- through the relay ----------------------------------------------------------------------------


def test_events_published_through_the_relay_are_each_taken_once_and_acknowledged_after_their_commit(
    db, rabbit
):
    url, engine = db
    exchange, queue = rabbit.exchange_name(), rabbit.queue_name()
    ob = Outbox()
    publisher = RabbitMQPublisher(BROKER, exchange, "orders.{event_type}", declare_exchange="topic")
    ob.route("order.*", publisher, name="orders_rabbit")
    inbox = Inbox("shipping")
    recording(inbox)
    declaration = QueueDeclaration(exchange, ["order.*"], routing_key="orders.{event_type}")
    source = AckWatch(RabbitMQConsumer(BROKER, queue, declare=declaration), engine, "shipping")
    inbox.consume(source)
    metrics = ConsumerMetrics()
    sessions = sessionmaker(engine)
    ob.install(sessions)
    try:
        with serving(Consumer(inbox, url, concurrency=4, metrics=metrics)) as errors:
            wait_until(ready(metrics, errors), "the consumer to be connected (its queue declared and bound)")
            with sessions.begin() as session:
                events = [
                    emit(session, "order.paid" if n % 2 else "order.placed", {"order_id": n})
                    for n in range(30)
                ]
            Relay(ob, engine).run_until_idle()
            wait_until(lambda: len(source.acked) == 30, "30 acknowledgements", timeout=30)
    finally:
        ob.uninstall(sessions)
    with engine.connect() as conn:
        assert Counter(conn.scalars(select(outbox_message.c.status))) == {"delivered": 30}
    assert effect_counts(engine) == Counter(str(e) for e in events)  # each event once, by its ce-id
    assert sorted(source.acked) == sorted((str(e), True) for e in events)  # each acked after its commit
    found = markers(engine)
    assert {row.outcome for row in found.values()} == {"handled"}
    assert {row.source for row in found.values()} == {f"rabbitmq:{queue}"}
    assert rabbit.depth(queue) == 0


def test_one_event_published_twice_has_one_effect_and_both_deliveries_are_acknowledged(db, rabbit):
    url, engine = db
    queue = rabbit.declare()
    twice = uuid.uuid4()
    publish("", queue, [event(1, event_id=twice), event(2), event(3, event_id=twice)])
    inbox = Inbox("dedupe")
    recording(inbox)
    inbox.consume(RabbitMQConsumer(BROKER, queue))
    metrics = ConsumerMetrics()
    with serving(Consumer(inbox, url, metrics=metrics)):
        wait_until(lambda: counted(metrics, "handled") + counted(metrics, "duplicate") == 3, "3 deliveries")
    assert counted(metrics, "duplicate") == 1
    assert sorted(effect_counts(engine).values()) == [1, 1]
    assert effect_counts(engine)[str(twice)] == 1
    assert rabbit.depth(queue) == 0


# -- failures and dead letters --------------------------------------------------------------------


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_failing_handler_is_redelivered_after_the_delay_then_dead_lettered_and_acknowledged(
    db, rabbit, queue_type
):
    url, engine = db
    queue = rabbit.queue_name()
    declaration = QueueDeclaration(None, queue_type=queue_type)
    inbox = Inbox("failing", max_failures=3)
    calls: list[tuple[int, float]] = []

    @inbox.handler("order.paid", name="fails")
    def fails(session: Session, message: InboxMessage) -> None:
        calls.append((message.attempt, time.monotonic()))
        raise RuntimeError("boom")

    inbox.consume(RabbitMQConsumer(BROKER, queue, declare=declaration))
    metrics = ConsumerMetrics()
    with serving(Consumer(inbox, url, retry_backoff=FixedDelay(0.3, 0.3), metrics=metrics)) as errors:
        wait_until(ready(metrics, errors), "the consumer to declare its queue")
        publish("", queue, [poison := event(1)])
        wait_until(lambda: str(poison.event_id) in markers(engine), "the dead letter's marker", timeout=30)
    assert [attempt for attempt, _ in calls] == [1, 2, 3]
    gaps = [later - earlier for (_, earlier), (_, later) in zip(calls, calls[1:], strict=False)]
    assert all(gap >= 0.25 for gap in gaps), gaps  # never sooner than the retry delay (0.3 s)
    assert markers(engine)[str(poison.event_id)].outcome == "dead"
    (dead,) = dead_letters(engine)
    assert (dead.message_id, dead.attempts, dead.error_type) == (str(poison.event_id), 3, "RuntimeError")
    assert "boom" in dead.error
    assert rabbit.depth(queue) == 0  # acknowledged once recorded


@pytest.mark.parametrize(("queue_type", "after_restart"), [("quorum", [2, 3]), ("classic", [1, 2, 3])])
def test_a_quorum_queue_keeps_the_attempt_across_a_restart_and_a_stop_hands_back_what_waits(
    db, rabbit, queue_type, after_restart
):
    url, engine = db
    queue = rabbit.declare(queue_type=queue_type)
    attempts: list[int] = []

    def failing_inbox() -> Inbox:
        inbox = Inbox("restarted", max_failures=3)

        @inbox.handler("order.paid", name="fails")
        def fails(session: Session, message: InboxMessage) -> None:
            attempts.append(message.attempt)
            raise RuntimeError("boom")

        return inbox

    publish("", queue, [poison := event(1)])
    first = failing_inbox()
    first.consume(RabbitMQConsumer(BROKER, queue))
    with serving(Consumer(first, url, retry_backoff=FixedDelay(600, 600))):  # held for ten minutes...
        wait_until(lambda: attempts == [1], "the first failure")
    # ... but a stop hands it back at once, for whoever consumes next (a quorum queue counts it a bit later).
    wait_until(lambda: rabbit.depth(queue) == 1, "the message back in its queue")
    attempts.clear()
    second = failing_inbox()
    second.consume(RabbitMQConsumer(BROKER, queue))
    with serving(Consumer(second, url, retry_backoff=FixedDelay(0.05, 0.05))):
        wait_until(lambda: str(poison.event_id) in markers(engine), "the dead letter's marker")
    assert attempts == after_restart  # a classic queue does not count deliveries: a new process starts at 1
    assert dead_letters(engine)[0].attempts == 3


def test_a_message_waiting_for_its_redelivery_does_not_hold_up_the_others(db, rabbit):
    url, engine = db
    queue = rabbit.declare()
    inbox = Inbox("busy")
    failures: list[int] = []

    @inbox.handler("#", name="effect")
    def effect(session: Session, message: InboxMessage) -> None:
        if message.payload.get("poison"):
            failures.append(message.attempt)
            raise RuntimeError("not now")
        session.execute(effects.insert().values(message_id=message.id))

    publish("", queue, [event(0, poison=True)])
    inbox.consume(RabbitMQConsumer(BROKER, queue, prefetch=3))
    with serving(Consumer(inbox, url, concurrency=2, retry_backoff=FixedDelay(600, 600))):
        wait_until(lambda: failures == [1], "the first failure: its redelivery is ten minutes away")
        publish("", queue, [event(n) for n in range(1, 11)])
        wait_until(lambda: sum(effect_counts(engine).values()) == 10, "the ten others, while one waits")
        assert failures == [1]
    wait_until(lambda: rabbit.depth(queue) == 1, "the waiting one, handed back by the stop")
    assert dead_letters(engine) == []


def test_undecodable_messages_are_dead_letters_before_they_are_acknowledged(db, rabbit):
    url, engine = db
    queue = rabbit.declare()
    broken_id = str(uuid.uuid4())
    rabbit.publish_raw(queue, b"{not json", {"ce-id": broken_id, "ce-type": "order.paid"})
    rabbit.publish_bare(queue, b"[1]", {"ce-type": "order.paid"})  # nothing to dedupe on
    rabbit.publish_raw(queue, b'{"a": 2}', {"ce-type": "order.paid"}, message_id="foreign-1")
    inbox = Inbox("strict")
    recording(inbox)
    inbox.consume(RabbitMQConsumer(BROKER, queue))
    metrics = ConsumerMetrics()
    with serving(Consumer(inbox, url, metrics=metrics)):
        wait_until(lambda: counted(metrics, "dead") == 2 and counted(metrics, "handled") == 1, "3 outcomes")
    assert effect_counts(engine) == {"foreign-1": 1}  # a foreign producer's AMQP message_id is its id
    by_id = {row.message_id: row for row in dead_letters(engine)}
    assert "not JSON" in by_id[broken_id].error
    (digest,) = [key for key in by_id if key != broken_id]
    assert digest.startswith("sha256:") and "no ce-id" in by_id[digest].error
    assert {row.attempts for row in by_id.values()} == {0}
    assert rabbit.depth(queue) == 0


# -- outages --------------------------------------------------------------------------------------


def test_a_broker_outage_is_waited_out_readiness_follows_and_nothing_is_lost_or_applied_twice(db, rabbit):
    url, engine = db
    queue = rabbit.declare()
    inbox = Inbox("outage")
    slow, started = threading.Event(), threading.Event()
    recording(inbox, slow=slow, started=started)
    metrics = ConsumerMetrics()
    with Forwarder(5672) as path:
        inbox.consume(RabbitMQConsumer(through(path.port), queue))
        first = [event(n) for n in range(10)]
        in_flight = event(10, slow=True)  # holds its transaction open: SQLite's other writers wait
        with serving(Consumer(inbox, url, metrics=metrics)) as errors:
            wait_until(ready(metrics, errors), "connected")
            publish("", queue, first)
            wait_until(lambda: sum(effect_counts(engine).values()) == 10, "the first 10")
            publish("", queue, [in_flight])
            wait_until(started.is_set, "one message in hand")
            path.cut()
            wait_until(lambda: not metrics.ready()[0], "readiness to drop", timeout=30)
            assert metrics.ready()[1] == f"not connected: rabbitmq:{queue}"
            slow.set()  # its commit succeeds; its acknowledgement cannot reach the broker
            wait_until(lambda: effect_counts(engine)[str(in_flight.event_id)] == 1, "the in-flight commit")
            second = [event(n) for n in range(11, 21)]
            publish("", queue, second)  # straight to the broker, while the consumer cannot reach it
            assert sum(effect_counts(engine).values()) == 11
            path.restore()
            wait_until(
                lambda: sum(effect_counts(engine).values()) == 21, "everything after the return", timeout=30
            )
            wait_until(ready(metrics, errors), "readiness back")
            wait_until(lambda: counted(metrics, "duplicate") == 1, "the in-flight message's redelivery")
    assert effect_counts(engine) == Counter(str(m.event_id) for m in [*first, in_flight, *second])
    assert rabbit.depth(queue) == 0


def test_a_queue_deleted_while_consuming_is_waited_for_not_a_configuration_error(db, rabbit, caplog):
    url, engine = db
    queue = rabbit.declare()
    inbox = Inbox("patient")
    recording(inbox)
    inbox.consume(RabbitMQConsumer(BROKER, queue))
    metrics = ConsumerMetrics()
    caplog.set_level("DEBUG", logger="outbox.integrations.rabbitmq")

    def said(action: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if getattr(r, "action", None) == action]

    with serving(Consumer(inbox, url, metrics=metrics)) as errors:
        wait_until(ready(metrics, errors), "connected")
        rabbit.delete_queue(queue)
        wait_until(lambda: not metrics.ready()[0], "readiness to drop")
        wait_until(lambda: len(said("broker_still_away")) >= 2, "two more tries while the queue is gone")
        # Said when it began (consumer cancelled) and when the reason changed (no queue), not at every try.
        cancelled, missing = said("broker_away")
        assert "cancelled the consumer" in cancelled and "NOT_FOUND" in missing
        rabbit.declare(queue.removeprefix(rabbit.prefix + "-"))
        wait_until(ready(metrics, errors), "connected again")
        publish("", queue, [again := event(1)])
        wait_until(lambda: effect_counts(engine) == {str(again.event_id): 1}, "the message after the return")


def test_two_consumers_given_the_same_message_at_once_apply_it_once(pg_db, rabbit):
    url, engine = pg_db
    exchange = rabbit.exchange_name()
    queues = [rabbit.queue_name("a"), rabbit.queue_name("b")]
    runs: list[tuple[Consumer, ConsumerMetrics]] = []
    for queue in queues:
        inbox = Inbox("shared")  # one consumer name: the same inbox, run twice

        @inbox.handler("#", name="effect")
        def effect(session: Session, message: InboxMessage) -> None:
            time.sleep(0.05)  # both hold the message for a while
            session.execute(effects.insert().values(message_id=message.id))

        inbox.consume(RabbitMQConsumer(BROKER, queue, declare=QueueDeclaration(exchange)))
        metrics = ConsumerMetrics()
        runs.append((Consumer(inbox, url, concurrency=4, metrics=metrics), metrics))
    (a, a_metrics), (b, b_metrics) = runs
    with serving(a) as a_errors, serving(b) as b_errors:
        wait_until(lambda: ready(a_metrics, a_errors)() and ready(b_metrics, b_errors)(), "both connected")
        sent = [event(n) for n in range(20)]
        publish(exchange, "{event_type}", sent)  # each message reaches both queues

        def taken(metrics: ConsumerMetrics) -> float:
            return counted(metrics, "handled") + counted(metrics, "duplicate")

        wait_until(lambda: taken(a_metrics) == 20 and taken(b_metrics) == 20, "both took all 20", timeout=30)
    assert effect_counts(engine) == Counter(str(m.event_id) for m in sent)
    assert counted(a_metrics, "handled") + counted(b_metrics, "handled") == 20
    assert counted(a_metrics, "duplicate") + counted(b_metrics, "duplicate") == 20
    assert [rabbit.depth(queue) for queue in queues] == [0, 0]


# -- configuration --------------------------------------------------------------------------------


def test_a_missing_queue_stops_the_consumer_at_start_with_its_name(db, rabbit):
    url, _ = db
    queue = rabbit.queue_name()
    inbox = Inbox("misconfigured")
    recording(inbox)
    inbox.consume(RabbitMQConsumer(BROKER, queue))
    with pytest.raises(ConfigurationError) as refused:
        Consumer(inbox, url).run()
    message = str(refused.value)
    assert f"queue {queue!r}" in message and "declare=QueueDeclaration" in message
    assert "\n" not in message and "guest:guest" not in message


def test_a_declaration_the_broker_refuses_stops_the_consumer_at_start_in_one_line(db, rabbit):
    url, _ = db
    queue = rabbit.declare(queue_type="classic")  # the declaration below asks for a quorum queue
    inbox = Inbox("misdeclared")
    recording(inbox)
    inbox.consume(RabbitMQConsumer(BROKER, queue, declare=QueueDeclaration(None)))
    with pytest.raises(ConfigurationError) as refused:
        Consumer(inbox, url).run()
    message = str(refused.value)
    assert f"queue {queue!r}" in message and "PRECONDITION_FAILED" in message and "x-queue-type" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"url": "http://127.0.0.1/"}, "amqp:// or amqps://"),
        ({"url": ""}, "non-empty string"),
        ({"queue": ""}, "queue must be a non-empty string"),
        ({"queue": "q" * 256}, "at most 255 bytes"),
        ({"queue": "amq.mine", "declare": QueueDeclaration("orders")}, "reserved"),
        ({"queue": "x" * 250}, "give a shorter name"),
        ({"name": ""}, "name"),
        ({"prefetch": 0}, "prefetch"),
        ({"prefetch": True}, "prefetch"),
        ({"connect_timeout": 0}, "connect_timeout"),
        ({"declare": {"exchange": "orders"}}, "QueueDeclaration"),
    ],
)
def test_bad_configuration_is_refused_when_the_consumer_is_made(kwargs, problem):
    args: dict[str, Any] = {"url": BROKER, "queue": "orders", **kwargs}
    with pytest.raises(ConfigurationError, match=problem):
        RabbitMQConsumer(args.pop("url"), args.pop("queue"), **args)


@pytest.mark.parametrize(
    ("args", "kwargs", "problem"),
    [
        (("",), {}, "exchange must be a non-empty string, or None"),
        (("orders", ["ord*"]), {}, "wildcards only as a whole"),
        (("orders", "order.*"), {}, "a list of event types"),
        (("orders", []), {}, "must not be empty"),
        (("orders",), {"routing_key": "{aggregate_type}.{event_type}"}, "from {event_type} alone"),
        (("orders",), {"routing_key": "{event_type"}, "routing_key"),
        (("orders",), {"declare_exchange": "fan-out"}, "declare_exchange"),
        (("amq.topic",), {}, "reserved"),
        (("orders",), {"queue_type": "stream"}, "queue_type"),
        (("orders",), {"arguments": {"x-queue-type": "classic"}}, "queue_type="),
        ((None, ["order.*"]), {}, "need an exchange"),
    ],
)
def test_bad_declarations_are_refused_when_made(args, kwargs, problem):
    with pytest.raises(ConfigurationError, match=re.escape(problem)):
        QueueDeclaration(*args, **kwargs)


def test_a_declaration_binds_what_the_publisher_publishes():
    declaration = QueueDeclaration("orders", ["order.*", "refund.#"], routing_key="orders.{event_type}")
    assert declaration.binding_keys == ("orders.order.*", "orders.refund.#")
    assert QueueDeclaration("amq.topic", declare_exchange=None).binding_keys == ("#",)
    assert QueueDeclaration(None).binding_keys == ()


def test_the_password_never_shows(db, rabbit, caplog):
    url, _ = db
    queue = rabbit.declare()
    wrong = re.sub(r"//([^:@/]+):[^@/]*@", r"//\1:s3cr3t%2Fpw@", BROKER)  # refused by the broker
    source = RabbitMQConsumer(wrong, queue)
    assert "s3cr3t" not in repr(source) + source.name + source.url
    assert set(source.outbox_secrets()) >= {"s3cr3t/pw", "s3cr3t%2Fpw"}
    inbox = Inbox("secretive")
    recording(inbox)
    inbox.consume(source)
    caplog.set_level("DEBUG")
    metrics = ConsumerMetrics()
    with serving(Consumer(inbox, url, metrics=metrics)):
        wait_until(
            lambda: any(getattr(r, "action", None) == "broker_away" for r in caplog.records),
            "the refusal logged",
        )
        assert not metrics.ready()[0]
    assert "s3cr3t" not in caplog.text


# -- the console script ---------------------------------------------------------------------------


def consumer_command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-consumer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.consumer"]


class ConsumerProcess:
    """``outbox-consumer --app rabbit_inbox_app:inbox`` (or ``app``), run in the log file's folder.

    Its output goes to that file, which the test reads.
    """

    def __init__(
        self, database_url: str, log_path: Path, *args: str, app: str = "rabbit_inbox_app:inbox", **env: str
    ) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                *consumer_command(),
                "--app",
                app,
                "--database-url",
                database_url,
                "--log-format",
                "json",
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=relay_env(database_url, **env),
            cwd=log_path.parent,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def actions(self) -> list[str]:
        found = []
        for line in self.text().splitlines():
            try:
                found.append(json.loads(line).get("action"))
            except (ValueError, AttributeError):
                continue
        return found

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def tail(self) -> str:
        return "\n".join(self.text().splitlines()[-15:])


def test_the_console_script_refuses_a_missing_queue_in_one_line(pg_db, rabbit, tmp_path):
    url, _ = pg_db
    queue = rabbit.queue_name()
    proc = ConsumerProcess(url, tmp_path / "consumer.log", RABBIT_URL=BROKER, RABBIT_QUEUE=queue)
    try:
        assert proc.proc.wait(60) == 2
    finally:
        proc.kill()
    last = proc.text().strip().splitlines()[-1]
    assert last.startswith("outbox-consumer: ") and f"queue {queue!r}" in last, proc.tail()
    assert "Traceback" not in proc.text()


def test_the_console_script_is_ready_while_connected_and_a_sigterm_lets_in_flight_finish(
    pg_db, rabbit, tmp_path
):
    url, engine = pg_db
    queue = rabbit.declare()
    gate, evidence = tmp_path / "gate", tmp_path / "evidence"
    evidence.mkdir()
    with Forwarder(5672) as path:
        proc = ConsumerProcess(
            url,
            tmp_path / "consumer.log",
            "--metrics-port",
            "0",
            RABBIT_URL=through(path.port),
            RABBIT_QUEUE=queue,
            RABBIT_INBOX_DIR=str(evidence),
            RABBIT_INBOX_GATE=str(gate),
        )
        try:
            port = int(
                wait_until(
                    lambda: re.search(r"metrics on http://[^:]+:(\d+)/", proc.text()), "the metrics port"
                )[1]
            )

            def readyz() -> int:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
                except httpx.HTTPError:
                    return 0

            def source_up() -> bool:
                try:
                    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                except httpx.HTTPError:
                    return False
                return (
                    f'outbox_inbox_source_up{{inbox="rabbit-inbox-test",source="rabbitmq:{queue}"}} 1.0'
                    in scraped
                )

            wait_until(lambda: source_up() and readyz() == 200, "/readyz 200 once connected", timeout=30)
            path.cut()
            wait_until(lambda: readyz() == 503, "/readyz 503 while the broker is cut off", timeout=30)
            path.restore()
            wait_until(lambda: source_up() and readyz() == 200, "/readyz 200 again", timeout=30)
            publish("", queue, [held := event(1)])
            wait_until(lambda: (evidence / f"started-{held.event_id}").exists(), "the handler to start")
            proc.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "drain" in proc.actions(), "the consumer to wait for the message in hand")
            assert proc.alive() and effect_counts(engine) == {}
            gate.touch()
            assert proc.proc.wait(60) == 0, proc.tail()
        finally:
            proc.kill()
    assert effect_counts(engine) == {str(held.event_id): 1}
    assert rabbit.depth(queue) == 0  # acknowledged before the exit


def test_the_guides_rabbitmq_consumer_runs_as_written(pg_db, rabbit, tmp_path):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "inbox.md").read_text()
    section = guide.split("### RabbitMQ", 1)[1].split("\n## ", 1)[0]
    (example,) = [
        block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "RabbitMQConsumer(" in block
    ]
    (command,) = re.findall(r"```console\n\$ (outbox-consumer .*?)\n```", section)
    module, app = re.fullmatch(r"outbox-consumer --app ((\w+):\w+) --database-url \S+", command).group(2, 1)
    url, engine = pg_db
    exchange, queue = rabbit.exchange_name(), rabbit.queue_name()
    for written in ('"amqp://guest:guest@127.0.0.1/"', '"shipping.orders"', 'QueueDeclaration("orders",'):
        assert written in example
    runnable = (
        example.replace('"amqp://guest:guest@127.0.0.1/"', repr(BROKER))
        .replace('"shipping.orders"', repr(queue))
        .replace('QueueDeclaration("orders",', f"QueueDeclaration({exchange!r},")
    )
    (tmp_path / f"{module}.py").write_text(runnable)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE shipments (order_id INTEGER NOT NULL)"))
    proc = ConsumerProcess(url, tmp_path / "consumer.log", app=app)
    try:
        wait_until(lambda: "source_up" in proc.actions() or not proc.alive(), "the queue declared and bound")
        assert proc.alive(), proc.tail()
        publish(exchange, "orders.{event_type}", [event(1, order_id=7)])

        def shipments() -> list[int]:
            with engine.connect() as conn:
                return list(conn.scalars(text("SELECT order_id FROM shipments")))

        wait_until(lambda: shipments() == [7], "the order's shipment")
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0, proc.tail()
    finally:
        proc.kill()
    assert rabbit.depth(queue) == 0


# -- the fault test -------------------------------------------------------------------------------


def test_kills_between_effect_and_acknowledgement_never_lose_or_repeat_an_effect(pg_db, rabbit, tmp_path):
    """KILL_MESSAGES messages (and 5% published twice) through consumers SIGKILLed again and again.

    A run ends in one of two faults: a SIGKILL from outside at a random
    moment (while starting, fetching, committing), or the consumer's own, at
    a random acknowledgement, between that message's commit and its ack: the
    window that makes redeliveries of committed messages. The first run ends
    in the second kind, the second run in the first, and after FAULTS runs
    the last one is let finish. Publishing goes on while the consumers run.
    """
    url, engine = pg_db
    started_at = time.monotonic()
    seed = int(os.environ.get("OUTBOX_INBOX_KILL_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    queue = rabbit.declare(queue_type="quorum")
    sent = [event(n) for n in range(KILL_MESSAGES)]
    again = [
        event(KILL_MESSAGES + n, event_id=m.event_id) for n, m in enumerate(rng.sample(sent, len(sent) // 20))
    ]
    everything = sent + again
    rng.shuffle(everything)
    publishing = threading.Thread(target=publish, args=("", queue, everything), name="publish")
    publishing.start()
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    env = {"RABBIT_URL": BROKER, "RABBIT_QUEUE": queue, "RABBIT_INBOX_DIR": str(evidence)}
    wanted = {str(m.event_id) for m in sent}

    def taken() -> int:
        with engine.connect() as conn:
            return int(conn.scalar(select(func.count()).select_from(outbox_inbox)) or 0)

    def done() -> bool:
        return not publishing.is_alive() and taken() == len(wanted) and rabbit.depth(queue) == 0

    runs, outside_kills = 0, 0
    try:
        while True:
            runs += 1
            assert runs < 100, f"seed {seed}: no end in sight"
            fault = "none" if runs > FAULTS else "own" if runs == 1 else "outside" if runs == 2 else None
            fault = fault or rng.choice(["own", "outside"])
            kill_at = (
                {"RABBIT_INBOX_KILL_AT": str(rng.randrange(1, max(2, KILL_MESSAGES // 10)))}
                if fault == "own"
                else {}
            )
            log = tmp_path / f"consumer-{runs}.log"
            proc = ConsumerProcess(url, log, "--concurrency", "8", **env, **kill_at)
            try:
                if fault != "outside":
                    lasts = 120.0  # until its own kill, or the end
                else:  # the first one early, so that even a short run has one
                    lasts = rng.uniform(1.5, 6.0) if runs > 2 else rng.uniform(0.5, 2.0)
                end = time.monotonic() + lasts
                while proc.alive() and time.monotonic() < end and not done():
                    time.sleep(0.1)
                if proc.alive() and done():  # the end: a graceful stop acknowledges what it has in hand
                    proc.proc.send_signal(signal.SIGTERM)
                    if proc.proc.wait(60) == 0 and rabbit.depth(queue) == 0:
                        break
                elif proc.alive():
                    assert fault == "outside", f"seed {seed}: stuck for two minutes\n{proc.tail()}"
                    proc.proc.send_signal(signal.SIGKILL)
                    outside_kills += 1
            finally:
                proc.kill()
            code = proc.proc.returncode
            assert code in (0, -signal.SIGKILL), f"seed {seed}: exited {code}\n{proc.tail()}"
    finally:
        publishing.join(120)
    took = time.monotonic() - started_at
    counts = effect_counts(engine)
    repeated = {k: v for k, v in counts.items() if v > 1}
    assert not repeated, (
        f"seed {seed}: {len(repeated)} messages applied twice, e.g. {list(repeated.items())[:5]}"
    )
    assert set(counts) == wanted, f"seed {seed}: lost {len(wanted - set(counts))}"
    own_kills = [p.name.removeprefix("kill-") for p in evidence.iterdir() if p.name.startswith("kill-")]
    assert own_kills and outside_kills, (
        f"seed {seed}: the faults did not happen ({own_kills}, {outside_kills})"
    )
    assert all(counts[m] == 1 for m in own_kills)  # committed, killed before the ack, redelivered: once
    print(
        f"\n{KILL_MESSAGES} messages (+{len(again)} published twice), {runs} consumer runs, "
        f"{outside_kills} SIGKILLs from outside, {len(own_kills)} between commit and ack, "
        f"{took:.1f}s, seed {seed}"
    )
