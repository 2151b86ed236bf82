"""KafkaConsumer, the inbox's Kafka source, against librdkafka's mock cluster (brokers on 127.0.0.1).

The consumer is the real confluent-kafka one, in a real consumer group: the
mock cluster speaks the Kafka protocol, group coordination included. What is
checked is what a user relies on: each record's effect once, in order per
partition, with the partition's next offset stored in the same transaction;
restarts and rebalances that neither skip nor re-read a record; failures
retried in place; and, in the subprocess tests, SIGKILLs at any moment
(tests/apps/kafka_inbox_app.py) that cost neither an effect nor a duplicate.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as KafkaClient
from confluent_kafka import Producer, TopicPartition
from kafkamock import MockCluster
from relayproc import APPS, relay_env
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Inbox, InboxMessage, Outbox, emit, outbox_inbox
from outbox._inbox.source import Ack, BeforeCommit, SourceContext
from outbox.consumer import Consumer
from outbox.integrations.kafka import KafkaConsumer, KafkaPublisher
from outbox.relay import Relay

sys.path.insert(0, str(APPS))
import kafka_inbox_app  # noqa: E402  (tests/apps is what the consumer subprocesses import it from, too)

TOPIC = "orders"
EVENT = "order.paid"
#: Group timings for tests: a member that died is noticed within two seconds, not forty-five.
QUICK_GROUP = {"session.timeout.ms": 1500, "heartbeat.interval.ms": 300}
FAST_RETRY = Backoff(base=0.05, cap=0.05)
o = outbox.outbox_inbox_offset
dead_letters = outbox.outbox_inbox_dead


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mc = MockCluster(brokers=1)
    mc.set_initial_rebalance_delay(50)
    mc.create_topic(TOPIC, partitions=3, replication=1)
    yield mc
    mc.close()


@pytest.fixture
def db(database_url: str) -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    engine = create_engine(database_url)
    if engine.dialect.name == "sqlite":
        outbox.enable_sqlite_savepoints(engine)  # concurrent transactions queue for the write lock
    kafka_inbox_app.metadata.create_all(engine)
    try:
        yield engine, sessionmaker(engine)
    finally:
        engine.dispose()


# -- helpers ----------------------------------------------------------------------------------------


def produce(
    cluster: MockCluster, records: Iterable[tuple[int, dict[str, str], bytes]], topic: str = TOPIC
) -> None:
    """``(partition, headers, body)`` records, written in order (an idempotent producer, acks=all)."""
    producer = Producer({"bootstrap.servers": cluster.bootstrap_servers, "enable.idempotence": True})
    for partition, headers, body in records:
        producer.produce(
            topic, value=body, partition=partition, headers=[(k, v.encode()) for k, v in headers.items()]
        )
    assert producer.flush(15) == 0


def event(message_id: str, body: Any, event_type: str = EVENT) -> tuple[dict[str, str], bytes]:
    return {"ce-id": message_id, "ce-type": event_type}, json.dumps(body).encode()


def events(partition: int, ids: Iterable[str]) -> list[tuple[int, dict[str, str], bytes]]:
    return [(partition, *event(i, {"id": i})) for i in ids]


def high_watermarks(cluster: MockCluster, partitions: int = 3, topic: str = TOPIC) -> dict[int, int]:
    client = KafkaClient(
        {"bootstrap.servers": cluster.bootstrap_servers, "group.id": "probe", "log_level": 0}
    )
    try:
        return {
            p: client.get_watermark_offsets(TopicPartition(topic, p), timeout=5)[1] for p in range(partitions)
        }
    finally:
        client.close()


def stored_offsets(engine: Engine, inbox: str) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(o.c.partition, o.c.next_offset).where(o.c.consumer == inbox, o.c.topic == TOPIC)
        )
        return {partition: offset for partition, offset in rows}


def effects(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(kafka_inbox_app.effects).order_by(kafka_inbox_app.effects.c.id)))


def markers(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(outbox_inbox)) or 0)


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


class Recorded:
    """A source whose every take and refusal is noted: (message id, outcome or None, attempt)."""

    def __init__(self, source: KafkaConsumer) -> None:
        self.source = source
        self.taken: list[tuple[str, str | None, int]] = []

    @property
    def name(self) -> str:
        return self.source.name

    async def consume(self, context: SourceContext) -> None:
        await self.source.consume(_Noting(context, self.taken))  # type: ignore[arg-type]


class _Noting:
    def __init__(self, context: SourceContext, taken: list[tuple[str, str | None, int]]) -> None:
        self._context, self._taken = context, taken

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def take(
        self, message: InboxMessage, *, ack: Ack | None = None, before_commit: BeforeCommit | None = None
    ) -> Any:
        result = await self._context.take(message, ack=ack, before_commit=before_commit)
        self._taken.append((message.id, None if result is None else result.outcome, message.attempt))
        return result

    async def refuse(
        self,
        message: InboxMessage,
        error: BaseException,
        *,
        ack: Ack | None = None,
        before_commit: BeforeCommit | None = None,
    ) -> bool:
        done = await self._context.refuse(message, error, ack=ack, before_commit=before_commit)
        self._taken.append((message.id, "refused" if done else None, message.attempt))
        return done


def kafka_inbox(
    cluster: MockCluster, name: str = "shipping", group: str = "shipping", **options: Any
) -> tuple[Inbox, Recorded]:
    """An inbox like the subprocess app's (one row per effect), fed by a recorded KafkaConsumer."""
    inbox = Inbox(name, **options.pop("inbox", {}))
    inbox.handler("#", name="apply")(kafka_inbox_app.apply)
    source = Recorded(
        KafkaConsumer(
            cluster.bootstrap_servers,
            TOPIC,
            group,
            config={**QUICK_GROUP, **options.pop("config", {})},
            **options,
        )
    )
    inbox.consume(source)
    return inbox, source


@contextmanager
def serving(consumer: Consumer) -> Iterator[Consumer]:
    """Run ``consumer`` in a thread; stop it (gracefully) and wait for its end on the way out."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-consumer")
    thread.start()
    try:
        yield consumer
    finally:
        consumer.stop()
        thread.join(60)
    assert not thread.is_alive(), "the consumer did not stop"
    if errors:
        raise errors[0]


# -- delivery ---------------------------------------------------------------------------------------


def test_published_events_are_taken_once_each_in_order_with_their_offsets(db, cluster):
    engine, sessions = db
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    ob.route(
        EVENT, KafkaPublisher({"bootstrap.servers": cluster.bootstrap_servers}, TOPIC), name="orders_kafka"
    )
    ob.install(sessions)
    try:
        for seq in range(12):
            for order in ("a", "b", "c", "d"):
                with sessions.begin() as session:
                    emit(session, EVENT, {"order": order, "seq": seq}, group_key=f"order:{order}")
        Relay(ob, engine).run_until_idle()
    finally:
        ob.uninstall(sessions)
    with engine.connect() as conn:
        sent = {str(i) for i in conn.scalars(select(outbox.outbox_message.c.event_id))}
    assert len(sent) == 48
    inbox, source = kafka_inbox(cluster)
    with serving(Consumer(inbox, sessions, concurrency=4)):
        wait_until(lambda: markers(engine) == 48, what="48 markers")
        wait_until(
            lambda: (
                stored_offsets(engine, "shipping") == {p: n for p, n in high_watermarks(cluster).items() if n}
            )
        )

    done = effects(engine)
    assert sorted(row.message_id for row in done) == sorted(sent)
    assert [outcome for _, outcome, _ in source.taken] == ["handled"] * 48  # nothing read twice
    # Kafka's own offsets follow the database's, for lag tools (committed after it, never read back).
    client = KafkaClient(
        {"bootstrap.servers": cluster.bootstrap_servers, "group.id": "shipping", "log_level": 0}
    )
    try:
        lag = client.committed([TopicPartition(TOPIC, p) for p in range(3)], timeout=10)
    finally:
        client.close()
    assert {tp.partition: tp.offset for tp in lag if tp.offset >= 0} == stored_offsets(engine, "shipping")


def test_records_of_a_partition_are_taken_in_log_order(db, cluster):
    engine, sessions = db
    produce(cluster, [(n % 3, *event(f"m-{n}", {"n": n})) for n in range(90)])
    inbox, _ = kafka_inbox(cluster)
    with serving(Consumer(inbox, sessions, concurrency=8)):
        wait_until(lambda: markers(engine) == 90, what="90 markers")
    order = [int(row.message_id[2:]) for row in effects(engine)]
    for partition in range(3):
        mine = [n for n in order if n % 3 == partition]
        assert mine == sorted(mine) and len(mine) == 30


def test_a_restart_resumes_at_the_stored_offsets_and_reads_nothing_twice(db, cluster):
    engine, sessions = db
    produce(cluster, [(n % 3, *event(f"m-{n}", {"n": n})) for n in range(30)])
    inbox, first = kafka_inbox(cluster)
    with serving(Consumer(inbox, sessions)):
        wait_until(lambda: markers(engine) == 30, what="30 markers")
    assert sorted(stored_offsets(engine, "shipping").items()) == [(0, 10), (1, 10), (2, 10)]

    # More records, and three earlier events published again (a producer's retry).
    produce(cluster, [(n % 3, *event(f"m-{n}", {"n": n})) for n in (*range(30, 45), 0, 1, 2)])
    inbox, second = kafka_inbox(cluster)
    with serving(Consumer(inbox, sessions)):
        wait_until(lambda: sum(stored_offsets(engine, "shipping").values()) == 48, what="every offset")
    taken = Counter((message_id, outcome) for message_id, outcome, _ in second.taken)
    assert taken == Counter(
        {
            **{(f"m-{n}", "handled"): 1 for n in range(30, 45)},
            **{(f"m-{n}", "duplicate"): 1 for n in range(3)},
        }
    )
    assert len(effects(engine)) == 45
    assert stored_offsets(engine, "shipping") == {0: 16, 1: 16, 2: 16}


def test_a_partition_never_stored_starts_at_auto_offset_reset(db, cluster):
    engine, sessions = db
    produce(cluster, events(0, ["old-1", "old-2"]))
    inbox, _ = kafka_inbox(cluster, config={"auto.offset.reset": "latest"})
    with serving(Consumer(inbox, sessions)):
        # Once the consumer has found the partition's end, a new record is taken; until then
        # a new one may land before that end, so keep writing until one is.
        deadline = time.monotonic() + 30
        for n in range(1000):
            if markers(engine):
                break
            assert time.monotonic() < deadline, "no new record was taken"
            produce(cluster, events(0, [f"new-{n}"]))
            time.sleep(0.2)
        wait_until(
            lambda: stored_offsets(engine, "shipping") == {0: high_watermarks(cluster)[0]}, what="the end"
        )
    assert all(row.message_id.startswith("new-") for row in effects(engine))
