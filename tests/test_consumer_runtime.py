"""The consumer runtime (outbox.consumer.Consumer) against a source that is a plain in-process queue.

The broker sources are tested against their real servers in their own
modules; this one pins what every source relies on from the runtime: the
acknowledgement comes after the commit, failures are counted even when the
broker does not count them, an undecodable message is recorded before it is
acknowledged, a failing source is started again, and a stop lets the
messages in hand finish.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import ConfigurationError, Inbox, InboxMessage, outbox_inbox, outbox_inbox_dead
from outbox._backoff import Backoff
from outbox._inbox.cloudevents import from_cloudevent
from outbox._inbox.source import SourceContext
from outbox.consumer import Consumer, ConsumerUnavailable


class QueueSource:
    """A broker in miniature: deliveries in a list, acks recorded, unacked ones redelivered."""

    def __init__(self, name: str = "memory:test") -> None:
        self.name = name
        self.pending: list[tuple[dict[str, str], bytes, int]] = []
        self.acked: list[str] = []
        self.acked_committed: list[bool] = []
        self.check_committed: Any = None
        self.finished = asyncio.Event()
        self.starts = 0

    def publish(self, message_id: str | None, event_type: str | None, body: bytes, **extra: str) -> None:
        headers = dict(extra)
        if message_id is not None:
            headers["ce-id"] = message_id
        if event_type is not None:
            headers["ce-type"] = event_type
        self.pending.append((headers, body, 1))

    async def consume(self, context: SourceContext) -> None:
        self.starts += 1
        context.connected(True)
        while not context.stopping.is_set():
            if not self.pending:
                self.finished.set()
                await asyncio.sleep(0.01)
                continue
            headers, body, delivery = self.pending.pop(0)
            message, problem = from_cloudevent(headers, body, source=self.name, attempt=delivery)

            def ack(message_id: str = message.id) -> None:
                self.acked.append(message_id)
                if self.check_committed is not None:
                    self.acked_committed.append(self.check_committed(message_id))

            if problem is not None:
                ok = await context.refuse(message, problem, ack=ack)
            else:
                ok = await context.take(message, ack=ack) is not None
            if not ok:
                self.pending.append((headers, body, delivery + 1))


def _run(consumer: Consumer, until: Any, timeout: float = 30.0) -> None:
    """Serve in a thread until ``until()`` holds, then stop and wait for the end."""
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        end = time.monotonic() + timeout
        while not until():
            assert thread.is_alive() or not errors, errors
            if time.monotonic() > end:
                raise AssertionError("condition not reached")
            time.sleep(0.02)
    finally:
        consumer.stop()
        thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.fixture
def db(database_url: str) -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    engine = create_engine(database_url)
    try:
        yield engine, sessionmaker(engine)
    finally:
        engine.dispose()


def _markers(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(select(outbox_inbox.c.message_id, outbox_inbox.c.outcome)).all()
    return {message_id: outcome for message_id, outcome in rows}


def test_each_message_is_handled_once_and_acknowledged_after_its_commit(db) -> None:
    engine, sessions = db
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE effects (message_id VARCHAR(255) PRIMARY KEY)"))
    inbox = Inbox("runtime")

    @inbox.handler("order.#", name="apply")
    def apply(session: Session, message: InboxMessage) -> None:
        session.execute(text("INSERT INTO effects VALUES (:m)"), {"m": message.id})

    source = QueueSource()
    source.check_committed = lambda message_id: message_id in _markers(engine)
    for n in range(20):
        source.publish(f"m-{n}", "order.paid", b'{"n": %d}' % n)
    source.publish("m-3", "order.paid", b'{"n": 3}')  # a redelivery
    inbox.consume(source)
    _run(Consumer(inbox, sessions, concurrency=2), lambda: len(source.acked) == 21)
    with engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM effects")) == 20
    assert all(source.acked_committed)
    assert sorted(set(source.acked)) == sorted(f"m-{n}" for n in range(20))


def test_a_failing_handler_is_counted_by_the_runtime_and_becomes_a_dead_letter(db) -> None:
    engine, sessions = db
    inbox = Inbox("runtime", max_failures=3)
    calls: list[int] = []

    @inbox.handler("order.paid", name="fails")
    def fails(session: Session, message: InboxMessage) -> None:
        calls.append(message.attempt)
        raise RuntimeError("boom")

    source = QueueSource()
    source.publish("m-1", "order.paid", b"{}")
    inbox.consume(source)
    consumer = Consumer(inbox, sessions, retry_backoff=Backoff(base=0.01, cap=0.01))
    _run(consumer, lambda: source.acked == ["m-1"])
    assert calls == [1, 2, 3]
    assert _markers(engine) == {"m-1": "dead"}
    with engine.connect() as conn:
        dead = conn.execute(select(outbox_inbox_dead.c.attempts, outbox_inbox_dead.c.error)).one()
    assert dead.attempts == 3 and "boom" in dead.error


def test_an_undecodable_message_is_recorded_before_it_is_acknowledged(db) -> None:
    engine, sessions = db
    inbox = Inbox("runtime")
    inbox.handler("order.paid", name="noop")(lambda session, message: None)
    source = QueueSource()
    source.check_committed = lambda message_id: message_id in _markers(engine)
    source.publish("m-1", None, b"not json")
    inbox.consume(source)
    _run(Consumer(inbox, sessions), lambda: len(source.acked) == 1)
    assert source.acked_committed == [True]
    with engine.connect() as conn:
        dead = conn.execute(select(outbox_inbox_dead.c.event_type, outbox_inbox_dead.c.error)).one()
    assert dead.event_type == "(unknown)"
    assert "no ce-type" in dead.error and "not JSON" in dead.error


class Crashing(QueueSource):
    async def consume(self, context: SourceContext) -> None:
        if self.starts == 0:
            self.starts += 1
            raise OSError("connection refused")
        await super().consume(context)


def test_a_source_that_fails_is_started_again(db) -> None:
    _, sessions = db
    inbox = Inbox("runtime")
    inbox.handler("order.paid", name="noop")(lambda session, message: None)
    source = Crashing()
    source.publish("m-1", "order.paid", b"{}")
    inbox.consume(source)
    _run(Consumer(inbox, sessions), lambda: source.acked == ["m-1"])
    assert source.starts == 2


class Misconfigured(QueueSource):
    async def consume(self, context: SourceContext) -> None:
        raise ConfigurationError("queue 'orders' does not exist")


def test_a_configuration_error_stops_the_consumer_with_its_line(db) -> None:
    _, sessions = db
    inbox = Inbox("runtime")
    inbox.handler("order.paid", name="noop")(lambda session, message: None)
    inbox.consume(Misconfigured())
    with pytest.raises(ConfigurationError, match="does not exist"):
        Consumer(inbox, sessions).run()


def test_bad_configuration_is_refused_when_the_consumer_is_made(tmp_path) -> None:
    inbox = Inbox("runtime")
    with pytest.raises(ConfigurationError, match="no sources"):
        Consumer(inbox, f"sqlite:///{tmp_path}/x.db")
    inbox.consume(QueueSource())

    @inbox.handler("order.paid", name="coroutine")
    async def coroutine(session: Any, message: InboxMessage) -> None:
        return None

    with pytest.raises(ConfigurationError, match="coroutine function"):
        Consumer(inbox, f"sqlite:///{tmp_path}/x.db")
    with pytest.raises(ConfigurationError, match="a source named"):
        Inbox("other").consume(QueueSource(), QueueSource())


def test_a_database_without_the_tables_is_refused_at_start(tmp_path) -> None:
    inbox = Inbox("runtime")
    inbox.consume(QueueSource())
    with pytest.raises(ConsumerUnavailable, match="outbox migrate"):
        Consumer(inbox, f"sqlite:///{tmp_path}/empty.db").run()


def test_a_url_gets_the_inbox_outbox_installed_so_handlers_emit(database_url: str) -> None:
    ob = outbox.Outbox()
    ob.route("shipment.created", lambda message: None, name="notify")
    inbox = Inbox("runtime", outbox=ob)

    @inbox.handler("order.paid", name="ship")
    def ship(session: Session, message: InboxMessage) -> None:
        outbox.emit(session, "shipment.created", {"order": message.id})

    source = QueueSource()
    source.publish("m-1", "order.paid", b"{}")
    inbox.consume(source)
    _run(Consumer(inbox, database_url), lambda: source.acked == ["m-1"])
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(outbox.outbox_message)) == 1
    finally:
        engine.dispose()


def test_the_message_span_continues_the_producer_trace_and_handlers_emits_carry_it(database_url: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ob = outbox.Outbox(tracer_provider=provider)
    ob.route("shipment.created", lambda message: None, name="notify")
    inbox = Inbox("traced", outbox=ob)

    @inbox.handler("order.paid", name="ship")
    def ship(session: Session, message: InboxMessage) -> None:
        outbox.emit(session, "shipment.created", {"order": message.id})

    producer_trace, producer_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    source = QueueSource("rabbitmq:orders")
    source.publish("m-1", "order.paid", b"{}", traceparent=f"00-{producer_trace}-{producer_span}-01")
    inbox.consume(source)
    try:
        _run(Consumer(inbox, database_url), lambda: source.acked == ["m-1"])
    finally:
        provider.shutdown()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "process order.paid"]
    assert span.kind == SpanKind.CONSUMER
    assert format(span.context.trace_id, "032x") == producer_trace
    assert span.parent is not None and format(span.parent.span_id, "016x") == producer_span
    assert span.attributes["messaging.system"] == "rabbitmq"
    assert span.attributes["messaging.message.id"] == "m-1"
    assert span.attributes["outbox.outcome"] == "handled"
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            headers = conn.scalar(select(outbox.outbox_message.c.headers))
    finally:
        engine.dispose()
    trace_id, parent_id = headers["traceparent"].split("-")[1:3]
    assert trace_id == producer_trace and parent_id == format(span.context.span_id, "016x")


def test_a_running_consumer_takes_up_a_dead_letter_an_operator_requeued(db) -> None:
    from outbox import ops

    engine, sessions = db
    inbox = Inbox("runtime", max_failures=1)
    fixed = threading.Event()
    applied: list[int] = []

    @inbox.handler("order.paid", name="flaky")
    def flaky(session: Session, message: InboxMessage) -> None:
        if not fixed.is_set():
            raise RuntimeError("the bug")
        applied.append(message.attempt)

    source = QueueSource()
    source.publish("m-1", "order.paid", b"{}")
    inbox.consume(source)

    def requeued_and_handled() -> bool:
        if source.acked != ["m-1"]:
            return False
        (dead,) = ops.inbox_dead_letters(engine, consumer="runtime", status=None)
        if dead.status == "dead":
            fixed.set()  # the fix is deployed; the operator requeues
            ops.requeue_inbox_dead_letter(engine, dead.id, actor="ops", reason="bug fixed")
        return dead.status == "handled"

    _run(Consumer(inbox, sessions), requeued_and_handled, timeout=60)
    assert applied == [2]
    assert _markers(engine) == {"m-1": "dead"}  # the marker keeps what the delivery came to


def test_an_outage_of_the_consumers_database_uses_up_no_attempts(pg_url: str) -> None:
    """Deliveries that met a database error are taken off the broker's count before max_failures."""
    from sqlalchemy.engine import make_url
    from tcpforward import Forwarder

    real = make_url(pg_url)
    with Forwarder(real.port or 5432) as forwarder:
        engine = create_engine(real.set(port=forwarder.port), pool_pre_ping=True)
        inbox = Inbox("runtime", max_failures=2)
        seen: list[int] = []

        @inbox.handler("order.paid", name="fails_once")
        def fails_once(session: Session, message: InboxMessage) -> None:
            seen.append(message.attempt)
            if len(seen) == 1:
                raise RuntimeError("a bug that goes away")

        source = QueueSource()
        source.publish("m-1", "order.paid", b"{}")
        cut_deliveries: list[int] = []
        inner = source.consume

        async def consume(context: SourceContext) -> None:
            forwarder.cut()  # the database goes away as the first message arrives

            class Watching:
                def __getattr__(self, name: str) -> Any:
                    return getattr(context, name)

                async def take(self, message: InboxMessage, **kwargs: Any) -> Any:
                    result = await context.take(message, **kwargs)
                    if result is None and not seen:
                        cut_deliveries.append(message.attempt)
                        if len(cut_deliveries) == 3:
                            forwarder.restore()
                    return result

            await inner(Watching())  # type: ignore[arg-type]

        source.consume = consume  # type: ignore[method-assign]
        inbox.consume(source)
        consumer = Consumer(inbox, sessionmaker(engine), retry_backoff=Backoff(base=0.01, cap=0.01))
        try:
            _run(consumer, lambda: source.acked == ["m-1"], timeout=60)
        finally:
            engine.dispose()
    assert cut_deliveries == [1, 2, 3]  # the broker's counts while the database was away
    assert seen == [1, 2]  # its 4th and 5th deliveries: the outage counted for nothing
    with create_engine(pg_url).connect() as conn:
        assert conn.execute(select(outbox_inbox.c.outcome)).scalar_one() == "handled"


def test_readiness_waits_for_every_source_to_connect(db) -> None:
    from outbox.consumer import ConsumerMetrics

    _, sessions = db
    inbox = Inbox("runtime")
    inbox.handler("order.paid", name="noop")(lambda session, message: None)
    connect = threading.Event()

    class SlowToConnect(QueueSource):
        async def consume(self, context: SourceContext) -> None:
            while not connect.is_set() and not context.stopping.is_set():
                await asyncio.sleep(0.01)
            await super().consume(context)

    source = SlowToConnect()
    inbox.consume(source)
    metrics = ConsumerMetrics()
    answers: list[tuple[bool, str]] = []

    def ready_after_connecting() -> bool:
        if not answers:
            if metrics.up._value.get() != 1:  # serving, database checked, sources started
                return False
            answers.append(metrics.ready())
            connect.set()
            return False
        return metrics.ready()[0]

    _run(Consumer(inbox, sessions, metrics=metrics), ready_after_connecting)
    assert answers == [(False, "not connected: memory:test")]
