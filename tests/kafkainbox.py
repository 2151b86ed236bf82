"""What the Kafka inbox tests share: records written to the mock cluster, and what the database holds.

Records are written with the CloudEvents headers our publishers send
(``ce-id``, ``ce-type``), each to the partition a test names, so a test
knows which consumer reads which record. The effects are the rows
``tests/apps/kafka_inbox_app.py``'s handler inserts, one per effect.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from kafkamock import MockCluster
from relayproc import APPS
from sqlalchemy import func, select
from sqlalchemy.engine import Engine

import outbox

sys.path.insert(0, str(APPS))
import kafka_inbox_app  # noqa: E402  (tests/apps is what the consumer subprocesses import it from, too)

__all__ = [
    "EVENT",
    "TOPIC",
    "effects",
    "event",
    "events",
    "high_watermarks",
    "kafka_inbox_app",
    "markers",
    "new_cluster",
    "produce",
    "stored_offsets",
    "wait_until",
]

TOPIC = "orders"
EVENT = "order.paid"
Record = tuple[int, dict[str, str], bytes]


def new_cluster(partitions: int = 3) -> MockCluster:
    """One mock broker with topic ``orders``; a new group is assigned at once, not after seconds."""
    cluster = MockCluster(brokers=1)
    cluster.set_initial_rebalance_delay(50)
    cluster.create_topic(TOPIC, partitions=partitions, replication=1)
    return cluster


def produce(cluster: MockCluster, records: Iterable[Record]) -> None:
    """``(partition, headers, body)`` records, written in order (an idempotent producer, acks=all)."""
    producer = Producer(
        {"bootstrap.servers": cluster.bootstrap_servers, "enable.idempotence": True, "linger.ms": 5}
    )
    for partition, headers, body in records:
        while True:
            try:
                producer.produce(
                    TOPIC,
                    value=body,
                    partition=partition,
                    headers=[(k, v.encode()) for k, v in headers.items()],
                )
                break
            except BufferError:  # the local queue is full: let it drain
                producer.poll(0.1)
    assert producer.flush(30) == 0


def event(message_id: str, body: Any, event_type: str = EVENT) -> tuple[dict[str, str], bytes]:
    return {"ce-id": message_id, "ce-type": event_type}, json.dumps(body).encode()


def events(partition: int, ids: Iterable[str]) -> list[Record]:
    return [(partition, *event(i, {"id": i})) for i in ids]


def high_watermarks(cluster: MockCluster, partitions: int = 3) -> dict[int, int]:
    """Each partition's next offset to be written: where a consumer that took everything stands."""
    client = Consumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": "probe", "log_level": 0})
    try:
        return {
            p: client.get_watermark_offsets(TopicPartition(TOPIC, p), timeout=5)[1] for p in range(partitions)
        }
    finally:
        client.close()


def stored_offsets(engine: Engine, inbox: str) -> dict[int, int]:
    o = outbox.outbox_inbox_offset
    with engine.connect() as conn:
        rows = conn.execute(
            select(o.c.partition, o.c.next_offset).where(o.c.consumer == inbox, o.c.topic == TOPIC)
        )
        return {partition: offset for partition, offset in rows}


def effects(engine: Engine) -> list[Any]:
    table = kafka_inbox_app.effects
    with engine.connect() as conn:
        return list(conn.execute(select(table).order_by(table.c.id)))


def markers(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(outbox.outbox_inbox)) or 0)


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g}s")
        time.sleep(0.05)
