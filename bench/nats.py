"""Mode 7: publishing to NATS JetStream through the outbox relay vs the same client without it.

Both sides publish the same messages (the CloudEvents envelope, ``Nats-Msg-Id``)
with nats-py's ``js.publish``, each waiting for its JetStream ack, with as many
publishes in flight as the relay has deliveries (``--concurrency``), into a
stream of their own on the same server, in the same run:

- raw: one asyncio process builds each envelope and publishes it; the clock
  runs from the first publish to the last ack;
- outbox: one ``outbox-relay`` (``--app bench.nats:ob``), started first and
  left idle on LISTEN; the backlog is inserted in one transaction, and the
  clock runs from that commit to the relay's last outcome write, as mode 2.

Each result is checked: the stream holds exactly N messages with N distinct
``Nats-Msg-Id`` values, and (outbox) every message was delivered once with one
history row. The ratio is outbox msg/s over raw msg/s.

This module is also the relay's app: ``ob`` is configured from
``BENCH_NATS_URL``, ``BENCH_NATS_SUBJECT`` and ``BENCH_NATS_STREAM``.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from outbox import Backoff, Message, Outbox
from outbox.integrations._envelope import envelope
from outbox.integrations.nats import NatsPublisher

from .drain import RelaySettings, _timeout
from .harness import Scratch, prefill, relays, wait_drained, wait_listening
from .verify import Expected, Unverified, check_delivered, drain_window

__all__ = ["nats_publish", "ob"]

EVENT = "bench.nats"
ROUTE = "nats"

ob = Outbox(default_backoff=Backoff(base=0.01, cap=0.05))
ob.route(
    EVENT,
    NatsPublisher(
        os.environ.get("BENCH_NATS_URL", "nats://127.0.0.1:4222"),
        subject=os.environ.get("BENCH_NATS_SUBJECT", "bench.{event_type}"),
        stream=os.environ.get("BENCH_NATS_STREAM") or None,
    ),
    name=ROUTE,
)


async def _with_js(url: str, fn: Any) -> Any:
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        return await fn(nc.jetstream(timeout=10))
    finally:
        await nc.close()


def _stream(url: str, name: str, prefix: str) -> None:
    async def make(js: JetStreamContext) -> None:
        try:
            await js.delete_stream(name)
        except nats.js.errors.NotFoundError:
            pass
        await js.add_stream(name=name, subjects=[f"{prefix}.>"])

    asyncio.run(_with_js(url, make))


def _drop(url: str, name: str) -> None:
    async def drop(js: JetStreamContext) -> None:
        try:
            await js.delete_stream(name)
        except nats.js.errors.NotFoundError:
            pass

    asyncio.run(_with_js(url, drop))


def _check_stream(url: str, name: str, prefix: str, count: int) -> None:
    """Exactly ``count`` messages, with ``count`` distinct Nats-Msg-Id values."""

    async def read(js: JetStreamContext) -> tuple[int, int]:
        stored = (await js.stream_info(name)).state.messages
        # No acks: a consumer waiting for them would stop at max_ack_pending (1,000) messages.
        config = ConsumerConfig(ack_policy=AckPolicy.NONE)
        sub = await js.pull_subscribe(f"{prefix}.>", stream=name, config=config)
        ids: set[str] = set()
        while len(ids) < stored:
            for msg in await sub.fetch(1000, timeout=5):
                ids.add((msg.headers or {})["Nats-Msg-Id"])
        await sub.unsubscribe()
        return stored, len(ids)

    stored, distinct = asyncio.run(_with_js(url, read))
    if stored != count or distinct != count:
        raise Unverified(f"stream {name} holds {stored} messages, {distinct} distinct ids; expected {count}")


def _raw(url: str, prefix: str, stream: str, count: int, concurrency: int) -> tuple[float, float]:
    """Publish ``count`` messages with acks, ``concurrency`` at a time: the seconds and CPU seconds it took.

    The CPU is the process's own over the same span as the clock, so it sets
    beside the relay's CPU per message: when both are busy on one core each,
    their ratio bounds the rate ratio.
    """
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
    subject = f"{prefix}.{EVENT}"

    async def publish_all(js: JetStreamContext) -> tuple[float, float]:
        queue = iter(messages)

        async def worker() -> None:
            for message in queue:  # each worker takes the next message: `concurrency` in flight
                env = envelope(message)
                headers = {**env.headers, "Nats-Msg-Id": env.dedupe_id}
                await js.publish(subject, env.body, timeout=10, stream=stream, headers=headers)

        began, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - began, time.process_time() - cpu

    spent: tuple[float, float] = asyncio.run(_with_js(url, publish_all))
    return spent


def nats_publish(scratch: Scratch, *, url: str, count: int, settings: RelaySettings) -> dict[str, Any]:
    tag = f"{os.getpid()}"
    raw_stream, raw_prefix = f"BENCH_RAW_{tag}", f"benchraw{tag}"
    box_stream, box_prefix = f"BENCH_OUTBOX_{tag}", f"benchoutbox{tag}"
    try:
        _stream(url, raw_stream, raw_prefix)
        raw_seconds, raw_cpu = _raw(url, raw_prefix, raw_stream, count, settings.concurrency)
        _check_stream(url, raw_stream, raw_prefix, count)
        _drop(url, raw_stream)

        _stream(url, box_stream, box_prefix)
        db = scratch.postgres("nats")
        workdir = scratch.subdir("nats")
        env = {
            "BENCH_NATS_URL": url,
            "BENCH_NATS_SUBJECT": f"{box_prefix}.{{event_type}}",
            "BENCH_NATS_STREAM": box_stream,
        }
        args = [*settings.args(), "--app", "bench.nats:ob"]
        with relays(db, 1, args, workdir=workdir, env=env) as procs:
            wait_listening(db, procs)
            idle_cpu = procs[0].cpu_seconds()
            committed = prefill(db, ROUTE, count, app=ob)
            wait_drained(db, count, procs, _timeout(count))
            cpu = procs[0].cpu_seconds() - idle_cpu
            for proc in procs:
                proc.stop()
        check_delivered(db, Expected(count, relays=[p.name for p in procs]))
        _check_stream(url, box_stream, box_prefix, count)
        _, _, written = drain_window(db)
        box_seconds = written.timestamp() - committed
    finally:
        _drop(url, raw_stream)
        _drop(url, box_stream)
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
