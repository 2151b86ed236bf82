"""Mode 10: producing to Kafka (librdkafka's mock cluster) through the outbox relay vs the bare client.

A process of its own hosts one mock cluster (``kafkamock.py``: the real Kafka
protocol on 127.0.0.1, no server to install, its CPU in neither side's
figures); both sides produce the same
messages (the CloudEvents envelope, keyed by aggregate, ``acks=all``,
idempotent) into a topic of their own, each waiting for every delivery report,
with as many messages in flight as the relay has deliveries (``--concurrency``):

- raw: one confluent-kafka producer configured as ``KafkaPublisher``
  configures it, in a plain loop that produces while fewer than
  ``concurrency`` reports are outstanding and polls for reports otherwise;
  the clock runs from the first produce to the last report;
- outbox: one ``outbox-relay`` (``--app bench.kafka:ob``), started first and
  left idle on LISTEN; the backlog is inserted in one transaction, and the
  clock runs from that commit to the relay's last outcome write, as mode 2.

Each result is checked: every delivery report of the raw loop came back
without an error, the topic holds exactly N messages with N distinct
``ce-id`` values, and (outbox) every message was delivered once with one
history row. The ratio is outbox msg/s over raw msg/s.

This module is also the relay's app: ``ob`` is configured from
``BENCH_KAFKA_SERVERS`` and ``BENCH_KAFKA_TOPIC``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from outbox import Backoff, Message, Outbox
from outbox.integrations._envelope import envelope
from outbox.integrations._kafka_config import producer_config
from outbox.integrations.kafka import KafkaPublisher

from .drain import RelaySettings, _timeout
from .harness import REPO_ROOT, Scratch, prefill, relays, wait_drained, wait_listening
from .verify import Expected, Unverified, check_delivered, drain_window

__all__ = ["kafka_produce", "ob"]

EVENT = "bench.kafka"
ROUTE = "kafka"
DELIVERY_TIMEOUT = 30.0
PARTITIONS = 3

ob = Outbox(default_backoff=Backoff(base=0.01, cap=0.05))
ob.route(
    EVENT,
    KafkaPublisher(
        {"bootstrap.servers": os.environ.get("BENCH_KAFKA_SERVERS", "127.0.0.1:9092")},
        topic=os.environ.get("BENCH_KAFKA_TOPIC", "bench"),
        delivery_timeout=DELIVERY_TIMEOUT,
    ),
    name=ROUTE,
)


def _raw(servers: str, topic: str, count: int, window: int) -> tuple[float, float]:
    """Produce ``count`` messages, ``window`` reports outstanding at most: the seconds and CPU seconds."""
    now = datetime.now(UTC)
    messages = [
        Message(
            id=n + 1,
            event_id=uuid.uuid4(),
            event_type=EVENT,
            handler=ROUTE,
            payload={"n": n, "fail": False},
            headers={},
            created_at=now,
        )
        for n in range(count)
    ]
    producer = Producer(producer_config({"bootstrap.servers": servers}, DELIVERY_TIMEOUT))
    outstanding = 0
    failed: list[str] = []

    def report(err: Any, msg: Any) -> None:
        nonlocal outstanding
        outstanding -= 1
        if err is not None:
            failed.append(err.name())

    began, cpu = time.perf_counter(), time.process_time()
    for message in messages:
        env = envelope(message)
        while outstanding >= window:
            producer.poll(0.1)
        producer.produce(
            topic,
            value=env.body,
            key=None if env.key is None else env.key.encode(),
            headers=[(name, value.encode()) for name, value in env.headers.items()],
            on_delivery=report,
        )
        outstanding += 1
        producer.poll(0)
    left = producer.flush(DELIVERY_TIMEOUT)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    if left or failed:
        raise Unverified(f"raw Kafka loop: {left} reports missing, {len(failed)} failed ({failed[:3]})")
    return seconds, cpu_seconds


def _check_topic(servers: str, topic: str, count: int) -> None:
    """Exactly ``count`` messages in ``topic``, with ``count`` distinct ce-id headers."""
    consumer = Consumer(
        {
            "bootstrap.servers": servers,
            "group.id": f"bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "log_level": 0,
        }
    )
    ids: set[Any] = set()
    stored = 0
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 60
        # Read up to what the brokers say the partitions hold: a count of quiet polls ended the
        # read before the first fetch on a loaded host, and found 0 messages.
        held = sum(
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(PARTITIONS)
        )
        while time.monotonic() < deadline and stored < held:
            batch = consumer.consume(1000, timeout=0.2)
            for msg in batch:
                if msg.error() is None:
                    stored += 1
                    ids.add(dict(msg.headers() or [])["ce-id"])
    finally:
        consumer.close()
    if stored != count or len(ids) != count:
        raise Unverified(
            f"topic {topic} holds {stored} messages, {len(ids)} distinct ce-ids; expected {count}"
        )


@contextmanager
def _cluster(*topics: str) -> Iterator[str]:
    """A mock cluster in a process of its own, with ``topics``: its bootstrap servers."""
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH")))),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from bench.kafkamock import serve; serve()", *topics],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=environ,
        text=True,
    )
    try:
        assert proc.stdout is not None
        servers = proc.stdout.readline().strip()
        if not servers:
            raise Unverified("the mock Kafka cluster did not start")
        yield servers
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def kafka_produce(scratch: Scratch, *, count: int, settings: RelaySettings) -> dict[str, Any]:
    raw_topic, box_topic = f"bench-raw-{os.getpid()}", f"bench-outbox-{os.getpid()}"
    with _cluster(raw_topic, box_topic) as servers:
        raw_seconds, raw_cpu = _raw(servers, raw_topic, count, settings.concurrency)
        _check_topic(servers, raw_topic, count)

        db = scratch.postgres("kafka")
        workdir = scratch.subdir("kafka")
        env = {"BENCH_KAFKA_SERVERS": servers, "BENCH_KAFKA_TOPIC": box_topic}
        args = [*settings.args(), "--app", "bench.kafka:ob"]
        with relays(db, 1, args, workdir=workdir, env=env) as procs:
            wait_listening(db, procs)
            idle_cpu = procs[0].cpu_seconds()
            committed = prefill(db, ROUTE, count, app=ob)
            wait_drained(db, count, procs, _timeout(count))
            cpu = procs[0].cpu_seconds() - idle_cpu
            for proc in procs:
                proc.stop()
        check_delivered(db, Expected(count, relays=[p.name for p in procs]))
        _check_topic(servers, box_topic, count)
        _, _, written = drain_window(db)
        box_seconds = written.timestamp() - committed
    raw_rate, box_rate = count / raw_seconds, count / box_seconds
    return {
        "raw_per_s": raw_rate,
        "outbox_per_s": box_rate,
        "ratio": box_rate / raw_rate,
        "raw_seconds": raw_seconds,
        "outbox_seconds": box_seconds,
        "relay_cpu_us_per_msg": 1e6 * cpu / count,
        "raw_cpu_us_per_msg": 1e6 * raw_cpu / count,
    }
