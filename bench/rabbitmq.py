"""Mode 7: 20,000 messages to RabbitMQ through the outbox, against the same client publishing them directly.

Both runs publish the same envelope (CloudEvents headers, persistent,
``mandatory``, publisher confirms) to one exchange whose one queue keeps
everything, with as many publishes in flight as the relay has deliveries
(``--concurrency``). The direct run is aio-pika alone: one connection, one
channel, a window of confirms, no database. The outbox run is one
``outbox-relay`` process draining a backlog committed in one transaction,
timed as mode 2 is (from that commit to the relay's last outcome write). The
direct run goes before and after it, so load that drifts during the mode
weighs on both sides; the ratio is outbox rate / mean direct rate. Each run must leave exactly ``count``
messages in the queue, and the outbox run the mode-2 history check.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
import psycopg
from sqlalchemy.engine import URL

from outbox import Message
from outbox._outbox import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE
from outbox.integrations._envelope import envelope

from .drain import RelaySettings, _timeout
from .harness import _PG_PREFILL, Scratch, conninfo, relays, wait_drained, wait_listening
from .verify import Expected, Unverified, check_delivered, drain_window

__all__ = ["EVENT", "ROUTE", "rabbitmq_publish"]

EVENT = "bench.rabbitmq"
ROUTE = "rabbitmq"


async def _declare(url: str, exchange: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC)
        q = await channel.declare_queue(queue)
        await q.bind(ex, "#")


async def _queue_depth(url: str, queue: str, *, purge: bool = False, delete: str | None = None) -> int:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        depth = q.declaration_result.message_count or 0
        if purge:
            await q.purge()
        if delete is not None:
            await channel.queue_delete(queue)
            await channel.exchange_delete(delete)
        return depth


async def _direct(url: str, exchange: str, count: int, window: int) -> float:
    """Publish ``count`` confirmed messages with ``window`` in flight; the seconds it took."""
    now = datetime.now(UTC)
    messages = [
        Message(
            id=n,
            event_id=uuid.uuid4(),
            event_type=EVENT,
            handler=ROUTE,
            payload={"n": n, "fail": False},
            created_at=now,
        )
        for n in range(count)
    ]
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        ex = await channel.get_exchange(exchange, ensure=True)
        slots = asyncio.Semaphore(window)

        async def publish(message: Message) -> None:
            async with slots:
                env = envelope(message)
                amqp = aio_pika.Message(
                    env.body,
                    headers={k: v for k, v in env.headers.items() if k != "content-type"},
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=env.id,
                    timestamp=message.created_at,
                    type=message.event_type,
                )
                await ex.publish(amqp, message.event_type, mandatory=True, timeout=30)

        began = time.monotonic()
        await asyncio.gather(*(publish(message) for message in messages))
        return time.monotonic() - began


def _prefill(url: URL, count: int) -> float:
    params = {
        "event_type": EVENT,
        "handler": ROUTE,
        "queue": DEFAULT_QUEUE,
        "priority": DEFAULT_PRIORITY,
        "max_attempts": DEFAULT_MAX_ATTEMPTS,
        "first": 0,
        "count": count,
        "fail_every": 0,
    }
    with psycopg.connect(conninfo(url)) as conn:
        conn.execute(_PG_PREFILL, params)
        conn.commit()
        return time.time()


def rabbitmq_publish(scratch: Scratch, *, broker: str, count: int, settings: RelaySettings) -> dict[str, Any]:
    tag = f"outbox-bench-{os.getpid()}"
    exchange, queue = tag, f"{tag}-q"
    asyncio.run(_declare(broker, exchange, queue))
    try:
        before = _direct_run(broker, exchange, queue, count, settings.concurrency)

        url = scratch.postgres("rabbitmq")
        workdir = scratch.subdir("rabbitmq")
        args = [*settings.args(), "--app", "bench.rabbit_app:ob"]  # the last --app wins
        env = {"BENCH_RABBITMQ_URL": broker, "BENCH_RABBITMQ_EXCHANGE": exchange}
        with relays(url, 1, args, workdir=workdir, env=env) as procs:
            wait_listening(url, procs)
            idle_cpu = procs[0].cpu_seconds()
            committed = _prefill(url, count)
            wait_drained(url, count, procs, _timeout(count))
            cpu = procs[0].cpu_seconds() - idle_cpu
            procs[0].stop()
        check_delivered(url, Expected(count, relays=[procs[0].name]))
        _, _, written = drain_window(url)
        outbox_seconds = written.timestamp() - committed
        depth = asyncio.run(_queue_depth(broker, queue, purge=True))
        if depth != count:
            raise Unverified(f"outbox run: {depth} messages in the queue, expected {count}")
        after = _direct_run(broker, exchange, queue, count, settings.concurrency)
    finally:
        asyncio.run(_queue_depth(broker, queue, delete=exchange))
    direct, through = 2 * count / (before + after), count / outbox_seconds
    return {
        "direct_per_s": direct,
        "direct_runs_per_s": (count / before, count / after),
        "outbox_per_s": through,
        "ratio": through / direct,
        "window": settings.concurrency,
        "relay_cpu_us_per_msg": 1e6 * cpu / count,
    }


def _direct_run(broker: str, exchange: str, queue: str, count: int, window: int) -> float:
    seconds = asyncio.run(_direct(broker, exchange, count, window))
    depth = asyncio.run(_queue_depth(broker, queue, purge=True))
    if depth != count:
        raise Unverified(f"direct run: {depth} messages in the queue, expected {count}")
    return seconds
