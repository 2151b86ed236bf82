"""NatsConsumer: an inbox fed by a JetStream durable pull consumer, against real nats-servers.

Every test makes its own stream. Tests that cut or restart a server start one of their own
(tests/natsserver.py) or cut a forwarder in front of one (tests/tcpforward.py); the shared server
on 4222 is never stopped. The fault test runs ``outbox-consumer`` processes on
tests/apps/nats_inbox_app.py and SIGKILLs them, some exactly between a commit and its ack.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import nats
import nats.js.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo
from natsserver import NatsServer
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
    Outbox,
    emit,
    outbox_inbox,
    outbox_inbox_dead,
)
from outbox.consumer import Consumer, ConsumerMetrics
from outbox.integrations.nats import NatsConsumer, NatsPublisher
from outbox.relay import Relay
from outbox.testing import messages

URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
#: SIGKILLs the fault test's driver deals out at most (the processes' own kills come on top).
MAX_KILLS = 20
T = TypeVar("T")

metadata = MetaData()
effects = Table(
    "effects",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("message_id", String(255), nullable=False),
    Column("attempt", Integer),
    Column("pid", Integer),
)


@pytest.fixture(autouse=True, scope="module")
def _server() -> None:
    try:
        socket.create_connection(("127.0.0.1", 4222), timeout=1).close()
    except OSError:  # a failure, never a skip: a skipped test would pass without testing anything
        pytest.fail(f"no NATS server at {URL}")


def admin(fn: Callable[[Any], Awaitable[T]], url: str = URL) -> T:
    """One admin call on a connection of its own (the consumer under test has its own)."""

    async def go() -> T:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(go())


def ce(message_id: str | None, event_type: str | None = "order.paid", **extra: str) -> dict[str, str]:
    """The CloudEvents headers our publishers send (binary mode)."""
    headers = {"ce-specversion": "1.0", "ce-source": "urn:test", "content-type": "application/json"}
    if message_id is not None:
        headers["ce-id"] = message_id
    if event_type is not None:
        headers["ce-type"] = event_type
    return headers | extra


@dataclass
class Stream:
    name: str
    prefix: str
    url: str = URL

    def publish(self, items: list[tuple[dict[str, str], bytes]], tail: str = "order.paid") -> None:
        """Store each (headers, body) in the stream, acked by JetStream, in order."""

        async def go(nc: Any) -> None:
            js = nc.jetstream()
            for headers, body in items:
                await js.publish(f"{self.prefix}.{tail}", body, headers=headers or None)

        admin(go, self.url)

    def blast(self, items: list[tuple[dict[str, str], bytes]]) -> None:
        """Many messages at once: plain publishes, then wait until the stream holds them all."""

        async def go(nc: Any) -> None:
            js = nc.jetstream()
            before = (await js.stream_info(self.name)).state.messages
            for headers, body in items:
                await nc.publish(f"{self.prefix}.order.paid", body, headers=headers)
            await nc.flush()
            deadline = time.monotonic() + 60
            while (await js.stream_info(self.name)).state.messages < before + len(items):
                assert time.monotonic() < deadline, "the stream did not store every message"
                await asyncio.sleep(0.05)

        admin(go, self.url)

    def consumer(self, durable: str) -> ConsumerInfo:
        async def go(nc: Any) -> ConsumerInfo:
            info: ConsumerInfo = await nc.jetstream().consumer_info(self.name, durable)
            return info

        return admin(go, self.url)

    def exists(self, durable: str) -> bool:
        try:
            self.consumer(durable)
        except nats.js.errors.NotFoundError:
            return False
        return True

    def settled(self, durable: str) -> bool:
        """Every stored message delivered to ``durable`` and acknowledged (False before it exists)."""
        try:
            info = self.consumer(durable)
        except nats.js.errors.NotFoundError:
            return False
        return info.num_pending == 0 and info.num_ack_pending == 0


def make_stream(url: str = URL) -> Stream:
    tag = uuid.uuid4().hex[:10]
    stream = Stream(f"OUTBOX_IN_{tag}", f"in{tag}", url)

    async def add(nc: Any) -> None:
        await nc.jetstream().add_stream(name=stream.name, subjects=[f"{stream.prefix}.>"])

    admin(add, url)
    return stream


@pytest.fixture
def stream() -> Iterator[Stream]:
    made = make_stream()
    yield made

    async def delete(nc: Any) -> None:
        try:
            await nc.jetstream().delete_stream(made.name)
        except nats.js.errors.NotFoundError:
            pass

    admin(delete)


@pytest.fixture
def db(database_url: str) -> Iterator[tuple[str, Engine]]:
    engine = create_engine(database_url)
    metadata.create_all(engine)
    yield database_url, engine
    engine.dispose()


def effect_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(select(effects.c.message_id, func.count()).group_by(effects.c.message_id))
        return {message_id: count for message_id, count in rows}


def markers(engine: Engine, consumer: str) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(outbox_inbox.c.message_id, outbox_inbox.c.outcome).where(
                outbox_inbox.c.consumer == consumer
            )
        )
        return {message_id: outcome for message_id, outcome in rows}


def applying_inbox(name: str = "orders-in", **options: Any) -> tuple[Inbox, list[InboxMessage]]:
    """An inbox whose handler records each message and writes one effect row per run."""
    inbox = Inbox(name, **options)
    seen: list[InboxMessage] = []

    @inbox.handler("#", name="apply")
    def apply(session: Session, message: InboxMessage) -> None:
        seen.append(message)
        session.execute(effects.insert().values(message_id=message.id, attempt=message.attempt))

    return inbox, seen


class FixedDelay(Backoff):
    """Every redelivery exactly ``base`` seconds later: a lower bound a test can check."""

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return self.base


@contextmanager
def serving(*consumers: Consumer) -> Iterator[None]:
    """Run each consumer in a thread of its own; stop them all and re-raise what they raised."""
    errors: list[BaseException] = []

    def serve(consumer: Consumer) -> None:
        try:
            consumer.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(c,)) for c in consumers]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for consumer in consumers:
            consumer.stop()
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]


def until(check: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    return wait_until(check, what, timeout=timeout, interval=0.05)


# -- configuration ----------------------------------------------------------------------------------


def test_bad_configuration_is_refused_at_construction() -> None:
    for args, kwargs, problem in (
        (("127.0.0.1:4222", "S", "d"), {}, "nats://host"),
        ((URL, "a.b", "d"), {}, "stream must be"),
        ((URL, "", "d"), {}, "stream must be"),
        ((URL, "S", "my durable"), {}, "durable must be"),
        ((URL, "S", "d"), {"subject": "orders.>.paid"}, "filter subject"),
        ((URL, "S", "d"), {"subject": "ord*"}, "filter subject"),
        ((URL, "S", "d"), {"subject": "orders..paid"}, "filter subject"),
        ((URL, "S", "d"), {"batch": 0}, "batch"),
        ((URL, "S", "d"), {"batch": True}, "batch"),
        ((URL, "S", "d"), {"ack_wait": 0.5}, "ack_wait"),
        ((URL, "S", "d"), {"ack_wait": float("inf")}, "ack_wait"),
        ((URL, "S", "d"), {"max_ack_pending": 0}, "max_ack_pending"),
        ((URL, "S", "d"), {"name": " "}, "name"),
        ((URL, "S", "d"), {"connect_options": {"max_reconnect_attempts": 3}}, "may not set"),
    ):
        with pytest.raises(ConfigurationError, match=problem):
            NatsConsumer(*args, **kwargs)
    with pytest.raises(ConfigurationError) as caught:
        NatsConsumer("http://user:hunter2@host:4222", "S", "d")
    assert "hunter2" not in str(caught.value)
    # Filters JetStream takes are accepted.
    for subject in ("orders.>", "orders.*.paid", ">", "orders.paid"):
        assert NatsConsumer(URL, "S", "d", subject=subject).subject == subject


def test_the_name_and_repr_never_carry_credentials() -> None:
    source = NatsConsumer("nats://alice:s3cr3t@127.0.0.1:4222", "ORDERS", "shipping")
    assert source.name == "nats:ORDERS/shipping"
    assert "s3cr3t" not in repr(source) and "alice" not in repr(source)
    assert "s3cr3t" in source.outbox_secrets()
    assert NatsConsumer(URL, "ORDERS", "shipping", name="orders").name == "orders"


def test_a_missing_stream_stops_the_consumer_with_a_line_naming_it(
    tmp_path: Path, sqlite_template: Path
) -> None:
    inbox, _ = applying_inbox()
    inbox.consume(NatsConsumer(URL, "OUTBOX_IN_NO_SUCH_STREAM", "d"))
    url = f"sqlite:///{tmp_path / 'x.db'}"
    Path(tmp_path / "x.db").write_bytes(sqlite_template.read_bytes())
    with pytest.raises(ConfigurationError, match="stream 'OUTBOX_IN_NO_SUCH_STREAM' does not exist"):
        Consumer(inbox, url).run()


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"deliver_subject": "somewhere.else"}, "push consumer"),
        ({"ack_policy": AckPolicy.ALL}, "explicit acks"),
        ({"filter_subject": "{prefix}.other"}, "filters"),
    ],
)
def test_an_existing_durable_that_would_break_the_promise_is_refused(
    stream: Stream, tmp_path: Path, sqlite_template: Path, config: dict[str, Any], problem: str
) -> None:
    settings = {k: v.format(prefix=stream.prefix) if isinstance(v, str) else v for k, v in config.items()}

    async def add(nc: Any) -> None:
        await nc.jetstream().add_consumer(stream.name, ConsumerConfig(durable_name="taken", **settings))

    admin(add)
    inbox, _ = applying_inbox()
    inbox.consume(NatsConsumer(URL, stream.name, "taken", subject=f"{stream.prefix}.order.paid"))
    Path(tmp_path / "x.db").write_bytes(sqlite_template.read_bytes())
    with pytest.raises(ConfigurationError, match=problem):
        Consumer(inbox, f"sqlite:///{tmp_path / 'x.db'}").run()


# -- through the real broker ------------------------------------------------------------------------


class AckWitness:
    """A source whose every ack first checks, on a connection of its own, that the marker is committed."""

    def __init__(self, inner: NatsConsumer, engine: Engine, inbox: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.engine = engine
        self.inbox = inbox
        self.acks: list[tuple[str, bool]] = []

    async def consume(self, context: Any) -> None:
        witness = self

        class Watching:
            def __getattr__(self, name: str) -> Any:
                return getattr(context, name)

            async def take(self, message: InboxMessage, *, ack: Any = None, before_commit: Any = None) -> Any:
                async def checked() -> None:
                    committed = message.id in markers(witness.engine, witness.inbox)
                    witness.acks.append((message.id, committed))
                    await ack()

                return await context.take(message, ack=checked, before_commit=before_commit)

        await self.inner.consume(Watching())


def test_what_the_relay_published_takes_effect_once_each_acked_after_its_commit(
    db: tuple[str, Engine], stream: Stream
) -> None:
    url, engine = db
    ob = Outbox()
    ob.route(
        "order.paid",
        NatsPublisher(URL, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name),
        name="to_nats",
    )
    maker = sessionmaker(engine)
    ob.install(maker)
    with maker.begin() as session:
        ids = [str(emit(session, "order.paid", {"n": n})) for n in range(30)]
    assert Relay(ob, engine).run_until_idle().delivered == 30
    # A producer's retry that the stream stored again (outside its duplicate window): same ce-id.
    stream.publish([(ce(message_id), json.dumps({"n": -1}).encode()) for message_id in ids[:5]])

    inbox, seen = applying_inbox()
    witness = AckWitness(NatsConsumer(URL, stream.name, "shipping"), engine, inbox.name)
    inbox.consume(witness)
    with serving(Consumer(inbox, url, concurrency=4)):
        until(lambda: len(witness.acks) == 35, "35 acks")
        until(lambda: stream.settled("shipping"), "every message acked")
    assert effect_counts(engine) == dict.fromkeys(ids, 1)
    assert all(committed for _, committed in witness.acks)
    assert sorted(set(markers(engine, inbox.name).values())) == ["handled"]
    first = next(message for message in seen if message.id == ids[0])
    assert (first.event_type, first.payload, first.source) == (
        "order.paid",
        {"n": 0},
        f"nats:{stream.name}/shipping",
    )
    assert first.sent_at is not None and first.attempt == 1
    # The durable this source made for itself.
    config = stream.consumer("shipping").config
    assert config.ack_policy == AckPolicy.EXPLICIT
    assert (config.ack_wait, config.max_ack_pending, config.max_deliver) == (30.0, 1000, -1)


def test_a_large_batch_gets_room_in_max_ack_pending_and_a_filter(
    stream: Stream, db: tuple[str, Engine]
) -> None:
    url, engine = db
    stream.publish([(ce("m-1"), b"{}")])
    stream.publish([(ce("m-2", "order.shipped"), b"{}")], tail="order.shipped")
    inbox, seen = applying_inbox()
    inbox.consume(
        NatsConsumer(URL, stream.name, "wide", subject=f"{stream.prefix}.order.paid", batch=300, ack_wait=5)
    )
    with serving(Consumer(inbox, url)):
        until(lambda: stream.settled("wide"), "the filtered message acked")
    assert [message.id for message in seen] == ["m-1"]
    config = stream.consumer("wide").config
    assert (config.max_ack_pending, config.ack_wait, config.filter_subject) == (
        3000,
        5.0,
        f"{stream.prefix}.order.paid",
    )


def test_a_failing_handler_is_redelivered_after_the_delay_then_dead_lettered_and_acked(
    db: tuple[str, Engine], stream: Stream
) -> None:
    url, engine = db
    inbox = Inbox("orders-in", max_failures=3)
    calls: list[tuple[int, float]] = []

    @inbox.handler("order.paid", name="fails")
    def fails(session: Session, message: InboxMessage) -> None:
        calls.append((message.attempt, time.monotonic()))
        raise RuntimeError("the warehouse is closed")

    inbox.consume(NatsConsumer(URL, stream.name, "shipping"))
    stream.publish([(ce("m-1"), b'{"order": 1}')])
    with serving(Consumer(inbox, url, retry_backoff=FixedDelay(base=0.5, cap=0.5))):
        until(lambda: markers(engine, "orders-in") == {"m-1": "dead"}, "the dead letter")
        until(lambda: stream.settled("shipping"), "the dead letter's message acked")
    assert [attempt for attempt, _ in calls] == [1, 2, 3]  # JetStream's delivery count
    # nak(delay=...): each redelivery came no sooner than the retry delay.
    assert all(later - earlier >= 0.5 for (_, earlier), (_, later) in zip(calls, calls[1:], strict=False))
    with engine.connect() as conn:
        dead = conn.execute(select(outbox_inbox_dead.c.attempts, outbox_inbox_dead.c.error)).one()
    assert dead.attempts == 3 and "warehouse is closed" in dead.error
    assert stream.consumer("shipping").delivered.consumer_seq == 3  # acked: not delivered a fourth time


def test_undecodable_and_id_less_messages_become_dead_letters_then_are_acked(
    db: tuple[str, Engine], stream: Stream
) -> None:
    url, engine = db
    stream.publish(
        [
            (ce("m-broken"), b"not json"),  # a body that is not JSON
            (ce(None), b'{"n": 1}'),  # no ce-id and no Nats-Msg-Id: a duplicate could not be told apart
            (ce(None) | {"Nats-Msg-Id": "producer-7"}, b'{"n": 2}'),  # the broker's message id stands in
        ]
    )
    inbox, seen = applying_inbox()
    inbox.consume(NatsConsumer(URL, stream.name, "shipping"))
    with serving(Consumer(inbox, url)):
        until(lambda: len(markers(engine, inbox.name)) == 3, "three markers")
        until(lambda: stream.settled("shipping"), "all three acked")
    assert [message.id for message in seen] == ["producer-7"]
    with engine.connect() as conn:
        dead = dict(conn.execute(select(outbox_inbox_dead.c.message_id, outbox_inbox_dead.c.error)).all())
    assert "not JSON" in dead.pop("m-broken")
    ((digest, error),) = dead.items()
    assert digest.startswith("sha256:") and "no ce-id" in error


def test_two_consumers_receiving_the_same_messages_at_once_apply_each_once(
    db: tuple[str, Engine], stream: Stream
) -> None:
    """Two durables on one stream: each message reaches both consumers at the same moment."""
    url, engine = db
    ids = [f"m-{n}" for n in range(40)]
    stream.publish([(ce(message_id), b"{}") for message_id in ids])
    consumers = []
    for durable in ("left", "right"):
        inbox = Inbox("orders-in")

        @inbox.handler("#", name="apply")
        def apply(session: Session, message: InboxMessage) -> None:
            time.sleep(0.01)  # both transactions are open at once more often than not
            session.execute(effects.insert().values(message_id=message.id, attempt=message.attempt))

        inbox.consume(NatsConsumer(URL, stream.name, durable))
        consumers.append(Consumer(inbox, url, concurrency=4))
    with serving(*consumers):
        until(lambda: stream.settled("left") and stream.settled("right"), "both durables acked everything")
    assert effect_counts(engine) == dict.fromkeys(ids, 1)
    for durable in ("left", "right"):  # the control: every message did reach both
        assert stream.consumer(durable).delivered.stream_seq == len(ids)


def test_a_long_transaction_keeps_its_message_past_the_ack_wait(
    db: tuple[str, Engine], stream: Stream
) -> None:
    url, engine = db
    inbox = Inbox("orders-in")

    @inbox.handler("#", name="slow")
    def slow(session: Session, message: InboxMessage) -> None:
        time.sleep(6.5)  # three and a quarter ack waits
        session.execute(effects.insert().values(message_id=message.id, attempt=message.attempt))

    inbox.consume(NatsConsumer(URL, stream.name, "shipping", ack_wait=2))
    stream.publish([(ce("m-1"), b"{}")])
    with serving(Consumer(inbox, url)):
        until(lambda: stream.settled("shipping"), "the message acked")
    assert effect_counts(engine) == {"m-1": 1}
    # in_progress kept it: JetStream delivered it once, never again after an expired ack wait.
    assert stream.consumer("shipping").delivered.consumer_seq == 1


def test_a_cut_connection_reconnects_loses_nothing_and_is_not_ready_meanwhile(
    pg_url: str, tmp_path: Path
) -> None:
    engine = create_engine(pg_url)
    metadata.create_all(engine)
    with NatsServer(tmp_path) as server, Forwarder(server.port) as forward:
        stream = make_stream(server.url)
        inbox, _ = applying_inbox()
        inbox.consume(NatsConsumer(f"nats://127.0.0.1:{forward.port}", stream.name, "shipping"))
        metrics = ConsumerMetrics()
        with serving(Consumer(inbox, pg_url, metrics=metrics)):
            stream.publish([(ce(f"a-{n}"), b"{}") for n in range(20)])
            until(lambda: len(effect_counts(engine)) == 20, "the first 20")
            until(lambda: metrics.ready()[0], "ready while connected")
            forward.cut()
            until(lambda: not metrics.ready()[0], "not ready while cut")
            assert "not connected" in metrics.ready()[1]
            stream.publish([(ce(f"b-{n}"), b"{}") for n in range(20)])  # straight to the server
            forward.restore()
            until(lambda: len(effect_counts(engine)) == 40, "the 20 published during the cut", timeout=60)
            until(lambda: metrics.ready()[0], "ready again")
            until(lambda: stream.settled("shipping"), "everything acked")
    assert set(effect_counts(engine).values()) == {1}
    engine.dispose()


def test_a_server_killed_and_restarted_mid_stream_loses_nothing_and_repeats_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    engine = create_engine(pg_url)
    metadata.create_all(engine)
    ids = [f"m-{n}" for n in range(300)]
    with NatsServer(tmp_path) as server:
        stream = make_stream(server.url)
        stream.publish([(ce(message_id), b"{}") for message_id in ids])
        inbox = Inbox("orders-in")

        @inbox.handler("#", name="apply")
        def apply(session: Session, message: InboxMessage) -> None:
            time.sleep(0.01)  # a backlog that outlasts the kill
            session.execute(effects.insert().values(message_id=message.id, attempt=message.attempt))

        inbox.consume(NatsConsumer(server.url, stream.name, "shipping", ack_wait=2))
        with serving(Consumer(inbox, pg_url, concurrency=4)):
            until(lambda: len(effect_counts(engine)) >= 50, "50 taken")
            server.kill()
            done_before = len(effect_counts(engine))
            time.sleep(1)  # an outage the source meets, not a blink
            server.start()
            until(lambda: len(effect_counts(engine)) == len(ids), "all taken", timeout=90)
            until(lambda: stream.settled("shipping"), "all acked", timeout=30)
    assert done_before < len(ids), "the kill must land while messages were left"
    assert effect_counts(engine) == dict.fromkeys(ids, 1)
    engine.dispose()


# -- the guide ------------------------------------------------------------------------------------


def test_the_guides_nats_example_takes_a_published_order_and_stops_on_sigterm(tmp_path: Path) -> None:
    guide = (Path(__file__).resolve().parents[1] / "docs" / "inbox.md").read_text()
    scripts = dict(re.findall(r"```python\n# file: (\S+)\n(.*?)```", guide, re.S))
    found = re.search(r"\n### NATS JetStream\n.*?```python\n(# consume_orders\.py.*?)```", guide, re.S)
    assert found is not None and "shipping.py" in scripts
    (tmp_path / "shipping.py").write_text(scripts["shipping.py"])
    with NatsServer(tmp_path) as server:
        assert found.group(1).count("nats://127.0.0.1:4222") == 1
        script = found.group(1).replace("nats://127.0.0.1:4222", server.url)
        (tmp_path / "consume_orders.py").write_text(script)

        async def add(nc: Any) -> None:
            await nc.jetstream().add_stream(name="ORDERS", subjects=["orders.>"])

        admin(add, server.url)
        orders = Stream("ORDERS", "orders", server.url)
        log = tmp_path / "consume_orders.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "consume_orders.py"],
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=relay_env(),
            )
        try:
            # shipping.py makes its database afresh at import: only then is it ours to read.
            until(lambda: "event emitted" in log.read_text() or proc.poll() is not None, "shipping.py run")
            until(lambda: orders.exists("shipping") or proc.poll() is not None, "the durable made")
            assert proc.poll() is None, log.read_text()
            orders.publish([(ce("order-41"), b'{"order_id": 41}')])
            engine = create_engine(f"sqlite:///{tmp_path / 'shipping.db'}")

            def shipped() -> bool:
                with engine.connect() as conn:
                    return 41 in conn.scalars(text("SELECT order_id FROM shipments")).all()

            until(shipped, "order 41 shipped", timeout=60)
            until(lambda: orders.settled("shipping"), "the order acked")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()
            assert len(messages(engine, event_type="shipment.created")) == 2  # shipping.py's, and order 41's
            engine.dispose()
        finally:
            proc.kill()
            proc.wait(30)


# -- outbox-consumer, as operators run it -----------------------------------------------------------


def consumer_command() -> list[str]:
    script = Path(sys.executable).with_name("outbox-consumer")
    return [str(script)] if script.exists() else [sys.executable, "-m", "outbox.consumer"]


class ConsumerProcess:
    """One ``outbox-consumer`` on tests/apps/nats_inbox_app.py; its output goes to a file."""

    def __init__(self, url: str, log: Path, args: list[str], env: dict[str, str]) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [*consumer_command(), "--app", "nats_inbox_app:inbox", "--database-url", url, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=relay_env(**env),
                cwd=log.parent,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(30)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])


def app_env(stream: Stream, server: str, **extra: str) -> dict[str, str]:
    return {
        "NATS_INBOX_SERVERS": server,
        "NATS_INBOX_STREAM": stream.name,
        "NATS_INBOX_DURABLE": "app",
        **extra,
    }


def readyz(port: int) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def test_outbox_consumer_is_ready_only_while_connected_and_sigterm_lets_the_message_in_hand_finish(
    db: tuple[str, Engine], stream: Stream, tmp_path: Path
) -> None:
    url, engine = db
    slow = tmp_path / "slow"
    slow.mkdir()
    with Forwarder(4222) as forward:
        env = app_env(stream, f"nats://127.0.0.1:{forward.port}", NATS_INBOX_SLOW_DIR=str(slow))
        process = ConsumerProcess(url, tmp_path / "consumer.log", ["--metrics-port", "0"], env)
        try:
            found = until(
                lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", process.log.read_text()),
                "the metrics port",
            )
            port = int(found.group(1))
            until(lambda: readyz(port) == 200, "/readyz 200 while connected")
            forward.cut()
            until(lambda: readyz(port) == 503, "/readyz 503 while NATS is cut")
            forward.restore()
            until(lambda: readyz(port) == 200, "/readyz 200 once reconnected")
            stream.publish([(ce("m-slow", "slow"), b"{}")])
            until(lambda: (slow / "m-slow").exists(), "the slow message in hand")
            process.proc.send_signal(signal.SIGTERM)
            assert process.proc.wait(60) == 0, process.tail()
        finally:
            process.kill()
    assert effect_counts(engine) == {"m-slow": 1}
    assert stream.settled("app"), "the message in hand was acked before the process exited"


def test_outbox_consumer_exits_2_with_one_line_naming_a_missing_stream(
    db: tuple[str, Engine], tmp_path: Path
) -> None:
    url, _ = db
    missing = Stream(f"OUTBOX_IN_MISSING_{uuid.uuid4().hex[:8]}", "unused")
    process = ConsumerProcess(url, tmp_path / "consumer.log", [], app_env(missing, URL))
    try:
        assert process.proc.wait(60) == 2, process.tail()
    finally:
        process.kill()
    lines = process.log.read_text().strip().splitlines()
    assert lines[-1] == (
        f"outbox-consumer: JetStream stream '{missing.name}' does not exist: create it, or correct stream="
    )
    assert "Traceback" not in process.log.read_text()


def test_ten_thousand_deliveries_through_sigkills_take_effect_exactly_once(
    pg_url: str, tmp_path: Path
) -> None:
    """The fault test: SIGKILLs at random moments, and exactly between commits and acks.

    Two ``outbox-consumer`` processes share one durable. A driver SIGKILLs one of them every
    0.5 to 2.5 seconds (``MAX_KILLS`` times at most, so a slow host does not buy itself more
    faults) and starts it again; each process also kills itself, with a small
    probability, in the ack the runtime calls after a commit. Some first deliveries fail (a nak,
    then a redelivery), and some messages are stored twice under one ce-id (a producer's
    retry). ``OUTBOX_INBOX_KILL_MESSAGES`` sets the count (default 10,000).
    """
    count = int(os.environ.get("OUTBOX_INBOX_KILL_MESSAGES") or 10_000)
    rng = random.Random(os.environ.get("OUTBOX_INBOX_KILL_SEED") or None)
    engine = create_engine(pg_url)
    metadata.create_all(engine)
    ids = [f"m-{n}" for n in range(count)]
    kill_log = tmp_path / "killed-before-ack"
    started = time.monotonic()
    with NatsServer(tmp_path) as server:
        stream = make_stream(server.url)
        now = datetime.now(UTC).isoformat()
        items = [(ce(message_id, **{"ce-time": now}), b'{"n": 1}') for message_id in ids]
        items += [rng.choice(items) for _ in range(count // 20)]  # stored twice, one ce-id
        stream.blast(items)
        env = app_env(
            stream,
            server.url,
            NATS_INBOX_ACK_WAIT="2",
            NATS_INBOX_KILL_BEFORE_ACK="0.001",
            NATS_INBOX_KILL_LOG=str(kill_log),
            NATS_INBOX_FAIL_FIRST="0.01",
        )
        # 8 at once each: two consumers' pools stay a small share of the server's 100 connections.
        args = ["--concurrency", "8", "--log-level", "WARNING"]
        processes = [ConsumerProcess(pg_url, tmp_path / f"consumer-{n}.log", args, env) for n in range(2)]
        kills = 0

        def taken() -> int:
            with engine.connect() as conn:
                return (
                    conn.scalar(
                        select(func.count())
                        .select_from(outbox_inbox)
                        .where(outbox_inbox.c.consumer == "nats-app")
                    )
                    or 0
                )

        try:
            next_kill = time.monotonic() + rng.uniform(0.5, 2.5)
            progress, progressed = -1, time.monotonic()
            while (done := taken()) < count:
                if done > progress:
                    progress, progressed = done, time.monotonic()
                stalled = time.monotonic() - progressed > 60  # a lost message stalls the count for good
                assert not stalled, f"{done} of {count} taken, none for 60s\n" + "\n".join(
                    p.tail() for p in processes
                )
                for n, process in enumerate(processes):
                    if not process.alive():  # killed itself between a commit and its ack
                        processes[n] = ConsumerProcess(pg_url, tmp_path / f"consumer-{n}.log", args, env)
                if kills < MAX_KILLS and time.monotonic() >= next_kill:
                    n = rng.randrange(len(processes))
                    processes[n].kill()
                    kills += 1
                    processes[n] = ConsumerProcess(pg_url, tmp_path / f"consumer-{n}.log", args, env)
                    next_kill = time.monotonic() + rng.uniform(0.5, 2.5)
                time.sleep(0.05)
            until(lambda: stream.settled("app"), "every delivery acked", timeout=60)
        finally:
            for process in processes:
                process.kill()
    took = time.monotonic() - started
    counts = effect_counts(engine)
    killed_before_ack = kill_log.read_text().split() if kill_log.exists() else []
    with engine.connect() as conn:
        redelivered = conn.scalar(select(func.count()).select_from(effects).where(effects.c.attempt > 1))
    engine.dispose()
    print(
        f"{count} messages, {kills} kills by the driver, {len(killed_before_ack)} between commit and ack, "
        f"{redelivered} effects on a redelivery, {took:.1f}s"
    )
    assert sorted(counts) == sorted(ids), "every message took effect"
    assert {n for n in counts.values()} == {1}, [m for m, n in counts.items() if n > 1][:10]
    # The controls: the faults happened.
    assert kills >= 5
    assert killed_before_ack, "no process was killed between a commit and its ack"
    assert redelivered, "no message took effect on a redelivery"
