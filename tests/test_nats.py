"""NatsPublisher against the real nats-server with JetStream: what a stream and its consumers get.

Every test makes its own stream (unique name and subjects) and deletes it.
The restart test kills and restarts a server of its own (tests/natsserver.py); the shared
server is never stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from natsserver import NatsServer
from relayproc import RelayProcess, wait_until
from sqlalchemy import create_engine, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, PermanentError, RetryLater, emit, ops
from outbox.integrations.nats import NatsPublisher
from outbox.relay import Relay

URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")
FAST = Backoff(base=0.001, cap=0.002)
m = outbox.outbox_message
a = outbox.outbox_attempt
T = TypeVar("T")


def run(fn: Callable[[nats.NATS], Awaitable[T]], url: str = URL) -> T:
    """One admin call on a connection of its own (the relay under test has its own)."""

    async def go() -> T:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return asyncio.run(go())


def nats_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 4222), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(autouse=True, scope="module")
def _server() -> None:
    if not nats_up():  # a failure, never a skip: a skipped test would pass without testing anything
        pytest.fail(f"no NATS server at {URL}")


@dataclass
class Stream:
    name: str
    prefix: str
    url: str = URL

    def messages(self) -> list[Any]:
        """Everything the stream holds, in order, read message by message."""

        async def read(nc: nats.NATS) -> list[Any]:
            js = nc.jetstream()
            state = (await js.stream_info(self.name)).state
            if not state.messages:
                return []
            return [await js.get_msg(self.name, seq) for seq in range(state.first_seq, state.last_seq + 1)]

        return run(read, self.url)


def make_stream(window: float = 120.0, url: str = URL) -> Stream:
    tag = uuid.uuid4().hex[:10]
    stream = Stream(f"OUTBOX_T_{tag}", f"t{tag}", url)

    async def add(nc: nats.NATS) -> None:
        await nc.jetstream().add_stream(
            name=stream.name, subjects=[f"{stream.prefix}.>"], duplicate_window=window
        )

    run(add, url)
    return stream


def drop_stream(stream: Stream) -> None:
    async def delete(nc: nats.NATS) -> None:
        try:
            await nc.jetstream().delete_stream(stream.name)
        except nats.js.errors.NotFoundError:
            pass

    run(delete, stream.url)


@pytest.fixture
def stream() -> Iterator[Stream]:
    made = make_stream()
    yield made
    drop_stream(made)


@pytest.fixture
def sqlite_engine(sqlite_template: Path, tmp_path: Path) -> Iterator[Engine]:
    path = tmp_path / "nats.db"
    shutil.copy(sqlite_template, path)
    eng = create_engine(f"sqlite:///{path}")
    yield eng
    eng.dispose()


def setup(engine: Engine, handler: Any, **route: Any) -> tuple[Outbox, sessionmaker[Session]]:
    ob = Outbox(default_backoff=FAST)
    ob.route("order.paid", handler, name="to_nats", **route)
    maker = sessionmaker(engine)
    ob.install(maker)
    return ob, maker


def emit_n(maker: sessionmaker[Session], n: int, **options: Any) -> None:
    with maker() as s, s.begin():
        for i in range(n):
            emit(s, "order.paid", {"n": i}, **options)


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def attempts(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def actions(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", None) == action]


# -- configuration ----------------------------------------------------------------------------------


def test_bad_configuration_is_refused_at_construction():
    for kwargs, problem in (
        ({"servers": "127.0.0.1:4222"}, "nats://host"),
        ({"servers": []}, "non-empty"),
        ({"servers": URL, "subject": "orders.*"}, "wildcards"),
        ({"servers": URL, "subject": "{nope}"}, "is not one of"),
        ({"servers": URL, "stream": "a.b"}, "stream name"),
        ({"servers": URL, "publish_timeout": 0}, "publish_timeout"),
        ({"servers": URL, "on_short_window": "ignore"}, "on_short_window"),
        ({"servers": URL, "subject": "o.{aggregate_id}", "on_short_window": "refuse"}, "needs stream"),
        ({"servers": URL, "connect_options": {"max_reconnect_attempts": 3}}, "may not set"),
    ):
        with pytest.raises(ConfigurationError, match=problem):
            NatsPublisher(**kwargs)
    with pytest.raises(ConfigurationError) as caught:
        NatsPublisher("http://user:hunter2@host:4222")
    assert "hunter2" not in str(caught.value)


def test_credentials_are_declared_secret_and_kept_out_of_repr():
    pub = NatsPublisher(["nats://alice:s3cr%21t@127.0.0.1:4222", "nats://tok3n@127.0.0.1:4223"])
    assert {"s3cr%21t", "s3cr!t", "tok3n"} <= set(pub.outbox_secrets())
    assert "s3cr" not in repr(pub) and "tok3n" not in repr(pub) and "alice" not in repr(pub)


# -- delivery ---------------------------------------------------------------------------------------


def test_each_message_reaches_a_consumer_once_with_envelope_headers_and_body(engine: Engine, stream: Stream):
    pub = NatsPublisher(URL, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name)
    ob, maker = setup(engine, pub)
    emit_n(maker, 40)
    result = Relay(ob, engine, concurrency=10).run_until_idle()
    assert result.delivered == 40

    async def consume(nc: nats.NATS) -> list[Any]:
        sub = await nc.jetstream().pull_subscribe(f"{stream.prefix}.>", stream=stream.name)
        got: list[Any] = []
        while len(got) < 40:
            got += await sub.fetch(40, timeout=2)
        with pytest.raises(nats.errors.TimeoutError):  # and nothing more
            await sub.fetch(1, timeout=0.3)
        for msg in got:
            await msg.ack()
        return got

    got = run(consume)
    stored = {r.id: r for r in rows(engine)}
    assert sorted(json.loads(msg.data)["n"] for msg in got) == list(range(40))
    by_id = {msg.headers["ce-id"]: msg for msg in got}
    assert len(by_id) == 40
    for row in stored.values():
        msg = by_id[str(row.event_id)]
        assert msg.subject == f"{stream.prefix}.order.paid"
        assert msg.headers["Nats-Msg-Id"] == f"{row.event_id}:to_nats"
        assert msg.headers["ce-type"] == "order.paid"
        assert msg.headers["ce-source"] == "urn:sqlalchemy-outbox:to_nats"
        assert msg.headers["content-type"] == "application/json"
        assert json.loads(msg.data) == row.payload
    details = [r.detail for r in attempts(engine)]
    assert all(d["stream"] == stream.name and d["duplicate"] is False for d in details)
    assert sorted(d["seq"] for d in details) == list(range(1, 41))


def _first_try_fails(message: Message) -> bool:
    return message.attempt == 1 and message.payload["i"] % 5 == 0


class _RetryFirst(NatsPublisher):
    """Every fifth message fails its first attempt before publishing: retries inside groups.

    It wraps ``__call__`` alone, so the relay calls it once per message.
    """

    async def __call__(self, message: Message) -> dict[str, Any]:
        if _first_try_fails(message):
            raise RetryLater("not yet")
        return await super().__call__(message)


class _RetryFirstBatch(NatsPublisher):
    """The same, for batches: the relay hands it a claim's messages at once."""

    batches: list[list[str]]

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        self.batches.append([str(msg.group_key) for msg in messages])
        sent = iter(await super().outbox_deliver_batch([m for m in messages if not _first_try_fails(m)]))
        return [RetryLater("not yet") if _first_try_fails(m) else next(sent) for m in messages]


@pytest.mark.parametrize("kind", [_RetryFirst, _RetryFirstBatch])
def test_group_key_keeps_per_key_order_through_retries(engine: Engine, stream: Stream, kind: Any):
    pub = kind(URL, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name)
    pub.batches = []
    ob, maker = setup(engine, pub)
    with maker() as s, s.begin():
        for i in range(60):
            emit(s, "order.paid", {"key": f"k{i % 4}", "i": i}, group_key=f"k{i % 4}")
    Relay(ob, engine, concurrency=8).run_until_idle()
    assert {r.status for r in rows(engine)} == {"delivered"}
    seen: dict[str, list[int]] = {}
    for msg in stream.messages():
        body = json.loads(msg.data)
        seen.setdefault(body["key"], []).append(body["i"])
    assert seen == {f"k{k}": list(range(k, 60, 4)) for k in range(4)}
    if kind is _RetryFirstBatch:  # a group's next message waits for the one before: one of each a batch
        assert pub.batches and max(len(b) for b in pub.batches) == 4
        assert all(len(set(b)) == len(b) for b in pub.batches)


class _Batches(NatsPublisher):
    """The real publisher, noting how many messages each batch the relay hands it holds."""

    sizes: list[int]

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[Any]:
        self.sizes.append(len(messages))
        return await super().outbox_deliver_batch(messages)


def test_a_claim_is_published_as_one_batch_and_each_message_fails_alone(engine: Engine, stream: Stream):
    """One subject no stream captures, one that is not a subject: dead alone; the batch's others stored."""
    pub = _Batches(URL, subject="{aggregate_type}.order", stream=stream.name)
    pub.sizes = []
    ob, maker = setup(engine, pub, max_attempts=3)
    emit_n(maker, 8)
    kinds = {n: f"{stream.prefix}.n{n}" for n in range(8)}
    kinds[3] = f"unstreamed{uuid.uuid4().hex[:8]}"  # no stream captures it
    kinds[5] = "not a subject"
    with engine.begin() as conn:
        for r in list(conn.execute(select(m.c.id, m.c.payload))):
            conn.execute(update(m).where(m.c.id == r.id).values(aggregate_type=kinds[r.payload["n"]]))

    Relay(ob, engine, concurrency=20).run_until_idle()

    assert pub.sizes == [8]
    state = {r.payload["n"]: (r.status, r.attempts) for r in rows(engine)}
    assert state == {n: ("dead", 1) if n in (3, 5) else ("delivered", 1) for n in range(8)}
    history = {h.message_id: h for h in attempts(engine)}
    by_n = {r.payload["n"]: history[r.id] for r in rows(engine)}
    assert len(history) == 8
    assert by_n[3].detail["reason"] == "no_stream" and by_n[3].detail["subject"] == f"{kinds[3]}.order"
    assert by_n[5].detail["reason"] == "bad_subject"
    assert sorted(by_n[n].detail["seq"] for n in (0, 1, 2, 4, 6, 7)) == list(range(1, 7))
    assert sorted(json.loads(msg.data)["n"] for msg in stream.messages()) == [0, 1, 2, 4, 6, 7]


# -- deduplication ----------------------------------------------------------------------------------


class _AckLost(NatsPublisher):
    """Publishes, then fails as if the ack had been lost: the message goes dead though the stream has it."""

    lost = True

    async def __call__(self, message: Message) -> dict[str, Any]:
        detail = await super().__call__(message)
        if self.lost:
            self.lost = False
            raise PermanentError("ack lost on the way back")
        return detail


def _requeue_after(engine: Engine, stream: Stream, wait: float) -> tuple[list[Any], list[Any]]:
    pub = _AckLost(URL, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name)
    ob, maker = setup(engine, pub)
    emit_n(maker, 1)
    Relay(ob, engine).run_until_idle()
    assert [r.status for r in rows(engine)] == ["dead"]
    time.sleep(wait)
    pairs = ops.requeue(engine, ops.MessageFilter(status="dead"), reason="test", actor="pytest")
    assert len(pairs) == 1
    Relay(ob, engine).run_until_idle()
    original, copy = rows(engine)
    assert copy.status == "delivered" and copy.event_id == original.event_id
    return stream.messages(), [r.detail for r in attempts(engine) if r.message_id == copy.id]


def test_a_requeued_copy_inside_the_window_is_dropped_as_a_duplicate(sqlite_engine: Engine, stream: Stream):
    stored, details = _requeue_after(sqlite_engine, stream, 0)
    assert len(stored) == 1
    assert (
        details[-1]["duplicate"] is True and details[-1]["seq"] == 1 and details[-1]["stream"] == stream.name
    )


def test_outside_the_window_a_requeued_copy_is_stored_again(sqlite_engine: Engine):
    short = make_stream(window=0.5)
    try:
        stored, details = _requeue_after(sqlite_engine, short, 0.8)
    finally:
        drop_stream(short)
    assert len(stored) == 2 and stored[0].headers["Nats-Msg-Id"] == stored[1].headers["Nats-Msg-Id"]
    assert details[-1]["duplicate"] is False and details[-1]["seq"] == 2


def test_a_relay_killed_between_publish_and_record_leaves_each_message_once(pg_url: str, tmp_path: Path):
    stream = make_stream()
    hang = tmp_path / "hang"
    hang.mkdir()
    env = {
        "NATS_APP_SERVERS": URL,
        "NATS_APP_SUBJECT": f"{stream.prefix}.{{event_type}}",
        "NATS_APP_STREAM": stream.name,
        "NATS_APP_HANG_DIR": str(hang),
    }
    engine = create_engine(pg_url)
    relay = None
    try:
        pub = NatsPublisher(URL, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name)
        ob = Outbox(default_backoff=FAST)
        ob.route("nats.crash", pub, name="crash_nats", max_attempts=5, timeout=120)
        maker = sessionmaker(engine)
        ob.install(maker)
        with maker() as s, s.begin():
            for i in range(5):
                emit(s, "nats.crash", {"n": i})
        args = ["--app", "nats_app:ob", "--lease", "2", "--concurrency", "10"]
        relay = RelayProcess(pg_url, args, log_path=tmp_path / "relay.log", env=env)
        wait_until(lambda: len(list(hang.iterdir())) == 5, "5 acked publishes", relays=[relay])
        relay.proc.send_signal(signal.SIGKILL)
        relay.kill()
        assert len(stream.messages()) == 5 and {r.status for r in rows(engine)} == {"running"}
        for _ in range(20):  # leases lapse (2 s), then the recovered messages fall due (ms)
            Relay(ob, engine, lease=2).run_until_idle()
            if {r.status for r in rows(engine)} == {"delivered"}:
                break
            time.sleep(0.3)
        stored = stream.messages()
        assert len(stored) == 5
        assert len({msg.headers["Nats-Msg-Id"] for msg in stored}) == 5
        history = attempts(engine)
        assert sorted(h.outcome for h in history) == ["delivered"] * 5 + ["lease_expired"] * 5
        assert all(h.detail["duplicate"] is True for h in history if h.outcome == "delivered")
    finally:
        if relay is not None:
            relay.kill()
        engine.dispose()
        drop_stream(stream)


# -- failures ---------------------------------------------------------------------------------------


def test_no_stream_for_the_subject_is_dead_with_the_reason(sqlite_engine: Engine):
    prefix = f"nostream{uuid.uuid4().hex[:8]}"
    ob, maker = setup(sqlite_engine, NatsPublisher(URL, subject=f"{prefix}.{{event_type}}"), max_attempts=5)
    emit_n(maker, 1)
    Relay(ob, sqlite_engine).run_until_idle()
    (row,) = rows(sqlite_engine)
    assert row.status == "dead" and row.attempts == 1
    assert "no JetStream stream captures subject" in row.last_error
    (attempt,) = attempts(sqlite_engine)
    assert attempt.detail["reason"] == "no_stream"


def test_no_ack_within_publish_timeout_is_a_retry_not_a_hang(sqlite_engine: Engine):
    """A responder that never answers stands in for a lost ack; a stream replaces it after one request."""
    prefix = f"silent{uuid.uuid4().hex[:8]}"
    stream = Stream(f"OUTBOX_T_{prefix}", prefix)
    ready, done = threading.Event(), threading.Event()

    async def silent() -> None:
        nc = await nats.connect(URL)

        async def swallow(msg: Any) -> None:
            await sub.unsubscribe()
            await nc.jetstream().add_stream(name=stream.name, subjects=[f"{prefix}.>"])

        sub = await nc.subscribe(f"{prefix}.>", cb=swallow)
        await nc.flush()
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(silent(),))
    thread.start()
    try:
        assert ready.wait(5)
        pub = NatsPublisher(URL, subject=f"{prefix}.{{event_type}}", publish_timeout=0.5)
        ob, maker = setup(sqlite_engine, pub, max_attempts=3)
        emit_n(maker, 1)
        began = time.monotonic()
        Relay(ob, sqlite_engine).run_until_idle()
        assert time.monotonic() - began < 5
        first, second = attempts(sqlite_engine)
        assert first.outcome == "retry" and first.detail["reason"] == "ack_timeout"
        assert (first.finished_at - first.started_at).total_seconds() < 1.5
        assert second.outcome == "delivered" and second.detail["seq"] == 1
        assert len(stream.messages()) == 1
    finally:
        done.set()
        thread.join(10)
        drop_stream(stream)


def test_server_restarted_during_a_run_loses_nothing(sqlite_engine: Engine, tmp_path: Path):
    """SIGKILL mid-run: no goodbye to clients; JetStream recovers the stream from its files at restart."""

    class Slow(NatsPublisher):
        async def __call__(self, message: Message) -> dict[str, Any]:
            await asyncio.sleep(0.01)  # a backlog that outlasts the outage's start
            return await super().__call__(message)

    with NatsServer(tmp_path) as server:
        stream = make_stream(url=server.url)
        pub = Slow(
            server.url, subject=f"{stream.prefix}.{{event_type}}", stream=stream.name, publish_timeout=1
        )
        # One attempt each: a restart that used up attempts would leave messages dead.
        ob, maker = setup(sqlite_engine, pub, max_attempts=1, backoff=Backoff(base=0.05, cap=0.5))
        emit_n(maker, 300)
        relay = Relay(ob, sqlite_engine, concurrency=4, poll_interval=0.1)
        thread = threading.Thread(target=relay.run)
        thread.start()
        try:
            wait_until(lambda: len(stream.messages()) >= 50, "50 messages stored", timeout=20)
            server.kill()
            time.sleep(1)  # an outage the relay meets with publishes, not a blink between two
            server.start()
            wait_until(
                lambda: {r.status for r in rows(sqlite_engine)} == {"delivered"}, "all delivered", timeout=30
            )
        finally:
            relay.stop()
            thread.join(30)
        stored = stream.messages()
    assert sorted(json.loads(msg.data)["n"] for msg in stored) == list(range(300))
    history = attempts(sqlite_engine)
    assert any(h.outcome == "retry" for h in history), "the outage must have been met by a publish"
    assert sum(h.outcome == "delivered" for h in history) == 300
    # What the outage cost: reconnecting, lost connections and a JetStream still recovering are
    # deferrals that use up no attempt.
    assert all(h.detail["counted"] is False for h in history if h.outcome == "retry")
    assert {r.attempts for r in rows(sqlite_engine)} == {1}


# -- the duplicate window check ---------------------------------------------------------------------


def test_a_window_shorter_than_the_longest_retry_gap_warns_or_refuses(
    sqlite_engine: Engine, caplog: pytest.LogCaptureFixture
):
    short = make_stream(window=1.0)
    try:
        subject = f"{short.prefix}.{{event_type}}"
        ob, maker = setup(sqlite_engine, NatsPublisher(URL, subject=subject), backoff=Backoff(1, 60))
        emit_n(maker, 1)
        with caplog.at_level(logging.INFO, "outbox"):
            assert Relay(ob, sqlite_engine, lease=5).run_until_idle().delivered == 1
        (warning,) = actions(caplog, "nats_window_short")
        assert warning.levelno == logging.WARNING and "drops duplicates for 1s" in warning.getMessage()
        assert warning.longest_retry_gap == 5 + 2.5 + 60 + 1.0

        strict = NatsPublisher(URL, subject=subject, stream=short.name, on_short_window="refuse")
        ob2, maker2 = setup(sqlite_engine, strict, backoff=Backoff(1, 60))
        emit_n(maker2, 1)
        with pytest.raises(ConfigurationError, match="is stored twice"):
            Relay(ob2, sqlite_engine).run_until_idle()
        assert [r.status for r in rows(sqlite_engine)] == ["delivered", "pending"]
    finally:
        drop_stream(short)


def test_a_window_covering_the_gap_is_reported_ok(sqlite_engine: Engine, stream: Stream, caplog):
    pub = NatsPublisher(URL, subject=f"{stream.prefix}.x", stream=stream.name, on_short_window="refuse")
    ob, maker = setup(sqlite_engine, pub, max_attempts=3, backoff=Backoff(0.5, 2))
    with caplog.at_level(logging.INFO, "outbox"):
        Relay(ob, sqlite_engine, lease=5).run_until_idle()
    assert actions(caplog, "nats_window_ok") and not actions(caplog, "nats_window_short")


def test_nats_down_at_start_defers_the_check_and_publishes_are_uncounted_retries(
    caplog: pytest.LogCaptureFixture,
):
    pub = NatsPublisher("nats://127.0.0.1:1", subject="down.{event_type}", publish_timeout=0.5)
    ob = Outbox()
    route = ob.route("order.paid", pub, name="to_nats")
    message = Message(id=1, event_id=uuid.uuid4(), event_type="order.paid", handler="to_nats", payload={})

    async def go() -> RetryLater:
        await pub.outbox_start(route, longest_retry_gap=10.0)
        try:
            await pub(message)
        except RetryLater as exc:
            return exc
        finally:
            await pub.outbox_shutdown()
        raise AssertionError("published without a server")

    with caplog.at_level(logging.INFO, "outbox"):
        began = time.monotonic()
        retry = asyncio.run(go())
    assert time.monotonic() - began < 10
    assert actions(caplog, "nats_window_deferred")
    assert not retry.counts_as_attempt and retry.detail == {"reason": "connect"}


def test_a_wildcard_route_checks_the_window_of_the_stream_it_names_or_refuses_without_one(
    sqlite_engine: Engine, stream: Stream, caplog: pytest.LogCaptureFixture
):
    subject = f"{stream.prefix}.{{event_type}}"
    ob = Outbox()
    route = ob.route("order.*", NatsPublisher(URL, subject=subject, on_short_window="refuse"), name="to_nats")
    with pytest.raises(ConfigurationError, match="is a pattern, so subject .* varies per message"):
        asyncio.run(route.handler.outbox_start(route, longest_retry_gap=10.0))

    # With the stream named, the check runs; each message's subject is made from its own event type.
    pub = NatsPublisher(URL, subject=subject, stream=stream.name, on_short_window="refuse")
    ob = Outbox(default_backoff=FAST)
    ob.route("order.*", pub, name="to_nats", max_attempts=3, backoff=Backoff(0.5, 2))
    maker = sessionmaker(sqlite_engine)
    ob.install(maker)
    with maker() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
        emit(s, "order.placed", {"n": 2})
    with caplog.at_level(logging.INFO, "outbox"):
        assert Relay(ob, sqlite_engine, lease=5).run_until_idle().delivered == 2
    assert actions(caplog, "nats_window_ok")
    assert sorted(msg.subject for msg in stream.messages()) == [
        f"{stream.prefix}.order.paid",
        f"{stream.prefix}.order.placed",
    ]
