"""KafkaPublisher against librdkafka's mock cluster (brokers on 127.0.0.1), through the real relay.

The mock cluster speaks the Kafka protocol, so the producer is the real one
(idempotent, acks=all) and a real confluent_kafka Consumer reads back what was
written. Faults are the mock cluster's own: request errors a real broker
answers with, and brokers that go down (see kafkamock.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from kafkamock import PRODUCE, MockCluster
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from stamped import as_reported

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, RetryLater, emit, ops
from outbox.integrations import _kafka_session, kafka
from outbox.integrations.kafka import KafkaPublisher
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt
SLOW = Backoff(base=60, cap=60)  # one attempt per run_until_idle; make_due() runs the next
TOPIC = "orders"
#: Publisher faults are the same whatever database the relay uses (the relay's own behaviour is tested
#: on both elsewhere): these tests run on SQLite only, to keep the file quick.
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mc = MockCluster(brokers=3)
    mc.create_topic(TOPIC, partitions=3)
    yield mc
    mc.close()


def publisher(cluster: MockCluster, **options: Any) -> KafkaPublisher:
    config = {"bootstrap.servers": cluster.bootstrap_servers, **options.pop("config", {})}
    return KafkaPublisher(config, options.pop("topic", TOPIC), **options)


def emit_one(
    maker: sessionmaker[Session],
    payload: dict[str, Any],
    aggregate: tuple[str, str] | None = None,
    **options: Any,
) -> None:
    """Emit one event; ``aggregate`` stands in for a mapped aggregate (what the model mixin stores)."""
    with maker() as s, s.begin():
        event_id = emit(s, "order.paid", payload, **options)
    if aggregate is not None:
        with maker() as s, s.begin():
            s.execute(
                update(m)
                .where(m.c.event_id == event_id)
                .values(aggregate_type=aggregate[0], aggregate_id=aggregate[1])
            )


def drain(ob: Outbox, engine: Engine, **relay: Any) -> None:
    """Run the relay until nothing is pending (the tests' backoffs are milliseconds)."""
    for _ in range(100):
        Relay(ob, engine, **relay).run_until_idle()
        with engine.connect() as conn:
            if not conn.execute(select(m.c.id).where(m.c.status == "pending")).first():
                return
        time.sleep(0.005)
    raise AssertionError("the relay never went idle")


def make_due(engine: Engine) -> None:
    """Skip the retry's wait (SLOW backoff) without sleeping through it."""
    with engine.begin() as conn:
        conn.execute(update(m).where(m.c.status == "pending").values(available_at=m.c.created_at))


def history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def consume(cluster: MockCluster, expected: int, topic: str = TOPIC, timeout: float = 10.0) -> list[Any]:
    """Every message of ``topic`` from the beginning, waiting until ``expected`` arrived (and a bit more)."""
    consumer = Consumer(
        {
            "bootstrap.servers": cluster.bootstrap_servers,
            "group.id": f"test-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=5).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = consumer.consume(100, timeout=0.2)
            got += [msg for msg in batch if msg.error() is None]
            if len(got) >= expected and not batch:
                break
        return got
    finally:
        consumer.close()


def headers_of(msg: Any) -> dict[str, str]:
    return {name: value.decode() for name, value in msg.headers() or []}


def report_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "outbox-kafka-reports"]


# -- delivery -------------------------------------------------------------------------------


def test_messages_arrive_with_the_cloudevents_envelope_keyed_by_aggregate(engine, ob, maker, cluster):
    ob.route("order.paid", publisher(cluster), name="orders_kafka")
    for i in range(24):
        emit_one(maker, {"order_id": i, "note": "naïve"}, aggregate=("order", str(i % 4)))
    drain(ob, engine)

    with engine.connect() as conn:
        rows = {str(r.event_id): r for r in conn.execute(select(m))}
    attempts = {h.message_id: h for h in history(engine)}
    got = consume(cluster, 24)
    assert len(got) == 24 and {headers_of(msg)["ce-id"] for msg in got} == set(rows)
    partition_of_key: dict[bytes, int] = {}
    for msg in got:
        headers = headers_of(msg)
        row = rows[headers["ce-id"]]
        assert row.status == "delivered"
        assert headers["ce-specversion"] == "1.0" and headers["ce-type"] == "order.paid"
        assert headers["ce-source"] == "urn:sqlalchemy-outbox:orders_kafka"
        assert headers["ce-subject"] == f"order/{row.aggregate_id}" and "ce-time" in headers
        assert headers["content-type"] == "application/json"
        assert msg.key() == row.aggregate_id.encode()
        assert json.loads(msg.value()) == row.payload
        # The history says where the message went, and that is where the consumer found it.
        assert as_reported(attempts[row.id].detail) == {
            "topic": TOPIC,
            "partition": msg.partition(),
            "offset": msg.offset(),
        }
        assert partition_of_key.setdefault(msg.key(), msg.partition()) == msg.partition()
    assert not report_threads()  # flushed and closed when the relay stopped


def test_per_key_order_with_group_key_survives_broker_retries(engine, ob, maker, cluster):
    quick_retries = {"retry.backoff.ms": 10, "retry.backoff.max.ms": 20}
    ob.route("order.paid", publisher(cluster, config=quick_retries), name="orders_kafka")
    for seq in range(15):
        for order in ("a", "b", "c"):
            emit_one(
                maker, {"order": order, "seq": seq}, aggregate=("order", order), group_key=f"order:{order}"
            )
    # A broker short of in-sync replicas for a while: librdkafka retries inside the attempt,
    # and the idempotent producer neither duplicates nor reorders.
    cluster.push_errors(PRODUCE, *[KafkaError.NOT_ENOUGH_REPLICAS] * 6)
    drain(ob, engine, concurrency=8)

    got = consume(cluster, 45)
    assert len(got) == 45
    for order in ("a", "b", "c"):
        mine = [json.loads(msg.value()) for msg in got if msg.key() == order.encode()]
        assert [p["seq"] for p in mine] == list(range(15))
        assert len({msg.partition() for msg in got if msg.key() == order.encode()}) == 1


def test_a_too_large_message_is_dead_at_once_and_its_requeued_copy_keeps_the_ce_id(
    engine, ob, maker, cluster
):
    ob.route("order.paid", publisher(cluster), name="orders_kafka", max_attempts=5)
    emit_one(maker, {"order_id": 1}, aggregate=("order", "1"))
    cluster.push_errors(PRODUCE, KafkaError.MSG_SIZE_TOO_LARGE)  # the broker's max.message.bytes
    drain(ob, engine)
    (dead,) = history(engine)
    assert dead.outcome == "dead"
    assert as_reported(dead.detail) == {"topic": TOPIC, "error": "MSG_SIZE_TOO_LARGE"}
    assert "MSG_SIZE_TOO_LARGE" in dead.error

    ((old_id, new_id),) = ops.requeue(
        engine, ops.MessageFilter(ids=(dead.message_id,)), reason="r", actor="t"
    )
    drain(ob, engine)
    with engine.connect() as conn:
        old, new = (conn.execute(select(m).where(m.c.id == i)).one() for i in (old_id, new_id))
    assert new.status == "delivered" and new.event_id == old.event_id
    (msg,) = consume(cluster, 1)
    assert headers_of(msg)["ce-id"] == str(old.event_id)


@sqlite_only
def test_a_message_over_the_producers_own_limit_is_dead_without_reaching_kafka(engine, ob, maker, cluster):
    ob.route("order.paid", publisher(cluster, config={"message.max.bytes": 2000}), name="orders_kafka")
    emit_one(maker, {"blob": "x" * 5000})
    drain(ob, engine)
    (dead,) = history(engine)
    assert dead.outcome == "dead" and dead.detail["error"] == "MSG_SIZE_TOO_LARGE"
    assert consume(cluster, 0, timeout=1.0) == []


class Batches(KafkaPublisher):
    """The real publisher, noting how many messages each batch the relay hands it holds."""

    sizes: list[int]

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        self.sizes.append(len(messages))
        return await super().outbox_deliver_batch(messages)


def test_a_claim_is_produced_as_one_batch_and_each_message_fails_alone(engine, ob, maker, cluster):
    """Too large for the producer, a topic it cannot name: dead alone, the batch's others written."""
    pub = Batches(
        {"bootstrap.servers": cluster.bootstrap_servers, "message.max.bytes": 2000},
        "{aggregate_type}",
    )
    pub.sizes = []
    ob.route("order.paid", pub, name="orders_kafka", max_attempts=3)
    payloads = {n: {"n": n} for n in range(8)}
    payloads[2] = {"n": 2, "blob": "x" * 5000}
    topics = {n: TOPIC for n in range(8)}
    topics[4] = "not a topic"
    for n in range(8):
        emit_one(maker, payloads[n], aggregate=(topics[n], str(n)))

    Relay(ob, engine, concurrency=20).run_until_idle()

    assert pub.sizes == [8]
    with engine.connect() as conn:
        numbers = {r.id: r.payload["n"] for r in conn.execute(select(m))}
        state = {r.payload["n"]: (r.status, r.attempts) for r in conn.execute(select(m))}
    assert state == {n: ("dead", 1) if n in (2, 4) else ("delivered", 1) for n in range(8)}
    tried = {numbers[h.message_id]: h for h in history(engine)}
    assert len(tried) == 8
    assert tried[2].detail["error"] == "MSG_SIZE_TOO_LARGE" and "topic" in tried[2].detail
    assert tried[4].detail["reason"] == "bad_topic"
    written = sorted((tried[n].detail["partition"], tried[n].detail["offset"]) for n in (0, 1, 3, 5, 6, 7))
    assert len(set(written)) == 6
    assert sorted(json.loads(msg.value())["n"] for msg in consume(cluster, 6)) == [0, 1, 3, 5, 6, 7]


# -- broker-side failures -------------------------------------------------------------------


@sqlite_only
def test_writes_refused_for_longer_than_delivery_timeout_are_retried(engine, ob, maker, cluster):
    route = publisher(cluster, delivery_timeout=1.5)
    ob.route("order.paid", route, name="orders_kafka", timeout=10, backoff=SLOW)
    emit_one(maker, {"order_id": 1}, aggregate=("order", "1"))
    cluster.push_errors(PRODUCE, *[KafkaError.NOT_ENOUGH_REPLICAS] * 100_000)
    Relay(ob, engine).run_until_idle()
    (first,) = history(engine)
    # The brokers would not take writes: a deferral that uses up no attempt.
    assert first.outcome == "retry" and as_reported(first.detail) == {
        "topic": TOPIC,
        "error": "_MSG_TIMED_OUT",
        "reason": "unavailable",
        "counted": False,
    }
    with engine.connect() as conn:
        assert conn.execute(select(m.c.attempts)).scalar_one() == 0

    cluster.clear_errors(PRODUCE)
    make_due(engine)
    drain(ob, engine)
    assert [h.outcome for h in history(engine)] == ["retry", "delivered"]
    assert len(consume(cluster, 1)) == 1  # the timed-out write was never taken: no duplicate


@sqlite_only
def test_an_authorization_error_is_retried_not_dead(engine, ob, maker, cluster):
    ob.route("order.paid", publisher(cluster), name="orders_kafka")
    emit_one(maker, {"order_id": 1})
    cluster.push_errors(PRODUCE, KafkaError.TOPIC_AUTHORIZATION_FAILED)  # an ACL not granted yet
    drain(ob, engine)
    # librdkafka refuses the topic locally until the publisher's metadata refresh answers:
    # with millisecond backoffs a retry or two may come first.
    *retries, last = history(engine)
    assert last.outcome == "delivered" and 1 <= len(retries) <= 5
    assert {(h.outcome, h.detail["error"]) for h in retries} == {("retry", "TOPIC_AUTHORIZATION_FAILED")}


@sqlite_only
def test_a_fatal_producer_error_is_retried_on_a_new_producer(engine, ob, maker, cluster, caplog):
    ob.route("order.paid", publisher(cluster), name="orders_kafka")
    emit_one(maker, {"order_id": 1}, aggregate=("order", "1"))
    emit_one(maker, {"order_id": 2}, aggregate=("order", "1"), group_key="order:1")
    # Sequence desynchronisation is fatal to an idempotent producer session.
    cluster.push_errors(PRODUCE, KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER)
    with caplog.at_level(logging.ERROR, logger="outbox.integrations.kafka"):
        drain(ob, engine, concurrency=1)
    outcomes = [(h.message_id, h.outcome) for h in history(engine)]
    assert outcomes[0][1] == "retry" and history(engine)[0].detail["reason"] == "fatal"
    assert {status for (status,) in _statuses(engine)} == {"delivered"}
    assert any("replaced" in r.getMessage() for r in caplog.records)
    assert len(consume(cluster, 2)) == 2


def _statuses(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.status)))


@sqlite_only
def test_brokers_down_is_a_retry_after_delivery_timeout_not_a_hang(engine, ob, maker, cluster, caplog):
    secret = "pw-" + uuid.uuid4().hex
    handler = publisher(cluster, delivery_timeout=1.5, config={"sasl.username": "u", "sasl.password": secret})
    ob.route("order.paid", handler, name="orders_kafka", timeout=10, backoff=SLOW)
    emit_one(maker, {"order_id": 1})
    cluster.set_down()
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG):
        Relay(ob, engine).run_until_idle()
    assert time.monotonic() - started < 1.5 + kafka.REPORT_GRACE + 3
    (first,) = history(engine)
    assert first.outcome == "retry" and "within" not in first.error  # librdkafka's own timeout
    assert first.detail["error"] == "_MSG_TIMED_OUT"

    cluster.set_up()
    make_due(engine)
    drain(ob, engine)
    assert [h.outcome for h in history(engine)] == ["retry", "delivered"]
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    with engine.connect() as conn:
        stored = repr(conn.execute(select(m)).all()) + repr(conn.execute(select(a)).all())
    assert secret not in logged and secret not in stored


def test_a_report_that_never_comes_is_a_retry(cluster, monkeypatch):
    """The backstop: librdkafka should always report, but a wedged client must not hang the relay."""
    monkeypatch.setattr(kafka, "REPORT_GRACE", 0.2)
    monkeypatch.setattr(_kafka_session.Session, "_serve", lambda self: None)  # nobody serves reports
    handler = publisher(cluster, delivery_timeout=1)
    msg = Message(id=1, event_id=uuid.uuid4(), event_type="order.paid", handler="k", payload={})

    async def once() -> None:
        try:
            await handler(msg)
        finally:
            await handler.outbox_shutdown()

    started = time.monotonic()
    with pytest.raises(RetryLater, match="no delivery report from Kafka within 1s") as raised:
        asyncio.run(once())
    assert time.monotonic() - started < 3
    assert raised.value.detail == {"reason": "timeout", "topic": TOPIC}


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        ({"enable.idempotence": False}, "must stay true"),
        ({"enable.idempotence": "false"}, "must stay true"),
        ({"acks": 1}, "must be 'all'"),
        ({"acks": "0"}, "must be 'all'"),
        ({"request.required.acks": "1"}, "must be 'all'"),
        ({"transactional.id": "tx"}, "cannot be set"),
        ({"on_delivery": print}, "cannot be set"),
        ({"delivery.report.only.error": True}, "cannot be set"),
        ({"message.timeout.ms": 60_000}, "from 1 to delivery_timeout"),
        ({"message.timeout.ms": 0}, "from 1 to delivery_timeout"),  # librdkafka's "forever"
        ({"delivery.timeout.ms": "forever"}, "from 1 to delivery_timeout"),
        ({"retries": 0}, "retries"),  # librdkafka's own check, at construction
        ({"max.in.flight": 10}, "max.in.flight"),
        ({"sasl.pasword": "x"}, "No such configuration property"),
        ({"bootstrap.servers": ""}, "needs 'bootstrap.servers'"),
    ],
)
def test_bad_configuration_is_refused_at_construction(config, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        KafkaPublisher({"bootstrap.servers": "127.0.0.1:9", **config})


def test_safe_settings_given_explicitly_are_accepted():
    for config in ({"enable.idempotence": True, "acks": "all"}, {"enable.idempotence": "true", "acks": -1}):
        KafkaPublisher({"bootstrap.servers": "127.0.0.1:9", **config, "message.timeout.ms": 5000})


@pytest.mark.parametrize(
    ("options", "complaint"),
    [
        ({"topic": "orders/{event_type}"}, "not '/'"),
        ({"topic": "{nope}"}, "is not one of"),
        ({"topic": ""}, "must not be empty"),
        ({"delivery_timeout": 0.5}, "delivery_timeout"),
        ({"delivery_timeout": float("nan")}, "delivery_timeout"),
        ({"delivery_timeout": True}, "delivery_timeout"),
        ({"source": ""}, "source"),
    ],
)
def test_bad_options_are_refused_at_construction(options, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        KafkaPublisher({"bootstrap.servers": "127.0.0.1:9"}, **options)


def test_secrets_are_declared_and_never_quoted():
    secret = "hunter2-" + uuid.uuid4().hex
    config = {"bootstrap.servers": "127.0.0.1:9", "sasl.password": secret, "ssl.key.password": "k-" + secret}
    handler = KafkaPublisher(config)
    assert set(handler.outbox_secrets()) == {secret, "k-" + secret}
    assert secret not in repr(handler)
    # librdkafka quotes an invalid value; a password pasted into the wrong property stays masked.
    with pytest.raises(ConfigurationError) as raised:
        KafkaPublisher({**config, "compression.type": secret})
    assert secret not in str(raised.value) and "***" in str(raised.value)


@sqlite_only
def test_a_topic_the_message_cannot_name_is_dead(engine, ob, maker, cluster):
    ob.route("order.paid", publisher(cluster, topic="orders.{aggregate_id}"), name="orders_kafka")
    emit_one(maker, {"order_id": 1}, aggregate=("order", "a/b"))
    emit_one(maker, {"order_id": 2})
    drain(ob, engine)
    bad_name, missing = history(engine)
    assert bad_name.outcome == missing.outcome == "dead"
    assert bad_name.detail["reason"] == "bad_topic" and "needs aggregate_id" in missing.error
