"""KafkaConsumer, the inbox's Kafka source, against librdkafka's mock cluster (brokers on 127.0.0.1).

The consumer is the real confluent-kafka one, in a real consumer group: the
mock cluster speaks the Kafka protocol, group coordination included. What is
checked is what a user relies on: each record's effect once, in order per
partition, with the partition's next offset stored in the same transaction;
restarts and rebalances that neither skip nor re-read a record; failures
retried in place. SIGKILLs at any moment, and the ``outbox-consumer``
command around the source, are in test_inbox_kafka_faults.py.
"""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer as KafkaClient
from confluent_kafka import TopicPartition
from kafkainbox import (
    EVENT,
    TOPIC,
    effects,
    event,
    events,
    high_watermarks,
    kafka_inbox_app,
    markers,
    new_cluster,
    produce,
    stored_offsets,
    wait_until,
)
from kafkamock import MockCluster
from relayproc import relay_env
from sqlalchemy import create_engine, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Inbox, InboxMessage, Outbox, emit
from outbox._inbox.source import Ack, BeforeCommit, SourceContext
from outbox._redact import Redactor
from outbox.consumer import Consumer
from outbox.integrations import _kafka_session
from outbox.integrations.kafka import KafkaConsumer, KafkaPublisher
from outbox.relay import Relay

#: Group timings for tests: a member that died is noticed within two seconds, not forty-five.
QUICK_GROUP = {"session.timeout.ms": 1500, "heartbeat.interval.ms": 300}
FAST_RETRY = Backoff(base=0.05, cap=0.05)
dead_letters = outbox.outbox_inbox_dead
#: Start-up refusals are the source's, whatever the database: SQLite only, to keep the file quick.
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    mc = new_cluster()
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
    inbox.handler("#", name="apply")(options.pop("handler", kafka_inbox_app.apply))
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


def test_published_events_are_taken_once_each_with_their_offsets_and_kafka_sees_the_lag(db, cluster):
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


# -- rebalances and concurrent consumers ----------------------------------------------------------


def slow_apply(session: Session, message: InboxMessage) -> None:
    time.sleep(0.005)
    kafka_inbox_app.apply(session, message)


@pytest.mark.parametrize("strategy", ["range", "cooperative-sticky"])
def test_a_consumer_joining_and_leaving_hands_partitions_over_without_a_gap_or_a_repeat(
    db, cluster, strategy
):
    """Eager rebalances (every partition revoked, then assigned) and cooperative ones (only those that move).

    Records keep coming while the second consumer joins and leaves, so both
    hand-overs happen with records in flight, whatever the rebalances take.
    """
    engine, sessions = db
    config = {"partition.assignment.strategy": strategy}
    one_inbox, one = kafka_inbox(cluster, name="shipping", handler=slow_apply, config=config)
    two_inbox, two = kafka_inbox(cluster, name="shipping", handler=slow_apply, config=config)
    with feeding(cluster) as fed, serving(Consumer(one_inbox, sessions, concurrency=3)):
        wait_until(lambda: markers(engine) >= 60, what="the first records")
        with serving(Consumer(two_inbox, sessions, concurrency=3)):  # joins the group, then leaves it
            wait_until(lambda: len(two.taken) >= 30, what="records taken by the second consumer")
        back = len(one.taken)
        wait_until(lambda: len(one.taken) >= back + 60, what="records taken after the second one left")
        fed.stop()
        wait_until(lambda: markers(engine) == fed.count, what="every record fed")

    taken = Counter(message_id for message_id, _, _ in one.taken + two.taken)
    assert set(taken.values()) == {1}, "a record was read twice"
    assert len(taken) == fed.count and {o for _, o, _ in one.taken + two.taken} == {"handled"}
    assert len(effects(engine)) == fed.count
    assert stored_offsets(engine, "shipping") == high_watermarks(cluster)


class Feeder:
    """Writes ten records to each partition every 0.1 s until stopped; ``count`` says how many so far."""

    def __init__(self, cluster: MockCluster) -> None:
        self.count = 0
        self._cluster = cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="test-feeder")
        self._thread.start()

    def _feed(self) -> None:
        while not self._stop.is_set():
            batch = [(n % 3, *event(f"m-{n}", {"n": n})) for n in range(self.count, self.count + 30)]
            produce(self._cluster, batch)
            self.count += len(batch)
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@contextmanager
def feeding(cluster: MockCluster) -> Iterator[Feeder]:
    feeder = Feeder(cluster)
    try:
        yield feeder
    finally:
        feeder.stop()


def test_two_consumers_taking_copies_of_a_message_at_once_apply_it_once(db, cluster):
    """Every event is in all three partitions, read at once by two consumers of the group: one effect."""
    engine, sessions = db
    one_inbox, one = kafka_inbox(cluster, name="shipping", group="shipping")
    two_inbox, two = kafka_inbox(cluster, name="shipping", group="shipping")
    with (
        serving(Consumer(one_inbox, sessions, concurrency=3)),
        serving(Consumer(two_inbox, sessions, concurrency=3)),
    ):
        deadline = time.monotonic() + 30
        while not (one.taken and two.taken):  # both are assigned partitions: both have taken something
            assert time.monotonic() < deadline, "the two consumers never both took a record"
            produce(cluster, [(p, *event(f"warm-{uuid.uuid4()}", {})) for p in range(3)])
            time.sleep(0.2)
        ids = [f"copy-{n}" for n in range(60)]
        produce(cluster, [(p, *event(i, {"id": i})) for i in ids for p in range(3)])
        wait_until(
            lambda: stored_offsets(engine, "shipping") == high_watermarks(cluster), what="every copy taken"
        )

    copies = [(m, outcome) for m, outcome, _ in one.taken + two.taken if m.startswith("copy-")]
    assert Counter(m for m, _ in copies) == {i: 3 for i in ids}
    assert Counter(m for m, outcome in copies if outcome == "handled") == {i: 1 for i in ids}
    done = Counter(row.message_id for row in effects(engine) if row.message_id.startswith("copy-"))
    assert done == {i: 1 for i in ids}
    both = {m for m, _, _ in one.taken} & {m for m, _, _ in two.taken}
    assert both & set(ids), "no message reached both consumers: nothing concurrent was tested"


# -- failures ---------------------------------------------------------------------------------------


def test_a_failing_record_is_taken_again_in_place_until_it_commits_or_is_a_dead_letter(db, cluster):
    """Kafka counts no deliveries: the runtime counts the handler's failures, and the attempt rises."""
    engine, sessions = db
    seen: list[tuple[str, int]] = []

    def failing(session: Session, message: InboxMessage) -> None:
        seen.append((message.id, message.attempt))
        if message.payload.get("poison"):
            raise RuntimeError("boom")
        if message.payload.get("flaky") and message.attempt < 3:
            raise RuntimeError(f"not yet ({message.attempt})")
        kafka_inbox_app.apply(session, message)

    produce(
        cluster,
        [
            (0, *event("ok-1", {})),
            (0, *event("poison", {"poison": True})),
            (0, *event("ok-2", {})),
            (1, *event("flaky", {"flaky": True})),
            (1, *event("ok-3", {})),
            (2, *event("ok-4", {})),
        ],
    )
    inbox, source = kafka_inbox(cluster, handler=failing, inbox={"max_failures": 3})
    with serving(Consumer(inbox, sessions, retry_backoff=FAST_RETRY)):
        wait_until(lambda: stored_offsets(engine, "shipping") == {0: 3, 1: 2, 2: 1}, what="every offset")

    assert [a for m, a in seen if m == "poison"] == [1, 2, 3]
    assert [a for m, a in seen if m == "flaky"] == [1, 2, 3]
    assert [o for m, o, _ in source.taken if m == "poison"] == [None, None, "dead"]
    assert [o for m, o, _ in source.taken if m == "flaky"] == [None, None, "handled"]
    order = [m for m, o, _ in source.taken if o is not None]
    assert order.index("ok-1") < order.index("poison") < order.index("ok-2")  # the partition waited
    assert order.index("flaky") < order.index("ok-3")
    assert sorted(row.message_id for row in effects(engine)) == ["flaky", "ok-1", "ok-2", "ok-3", "ok-4"]
    with engine.connect() as conn:
        dead = conn.execute(
            select(dead_letters.c.message_id, dead_letters.c.attempts, dead_letters.c.error)
        ).one()
    assert dead.message_id == "poison" and dead.attempts == 3 and "boom" in dead.error


def test_a_database_that_cannot_commit_holds_the_record_without_counting_a_failure(pg_url, cluster):
    """While the offsets' table is locked every transaction fails: the record waits, and none of that
    counts against it, so a handler's failure then is its first, not a dead letter."""
    engine = create_engine(pg_url, connect_args={"options": "-c lock_timeout=100ms"})
    kafka_inbox_app.metadata.create_all(engine)
    released = threading.Event()
    failed_once = threading.Event()
    seen: list[int] = []

    def once_more(session: Session, message: InboxMessage) -> None:
        if message.id == "second" and released.is_set():
            seen.append(message.attempt)
            if not failed_once.is_set():
                failed_once.set()
                raise RuntimeError("one failure, after the database is back")
        kafka_inbox_app.apply(session, message)

    inbox, source = kafka_inbox(cluster, handler=once_more, inbox={"max_failures": 2})
    try:
        with serving(Consumer(inbox, sessionmaker(engine), retry_backoff=FAST_RETRY)):
            produce(cluster, events(0, ["first"]))
            wait_until(lambda: markers(engine) == 1, what="the first record")
            with engine.connect() as locker, locker.begin():
                locker.execute(text("LOCK TABLE outbox_inbox_offset IN ACCESS EXCLUSIVE MODE"))
                produce(cluster, events(0, ["second"]))
                wait_until(lambda: sum(m == "second" for m, _, _ in source.taken) >= 4, what="four tries")
                released.set()  # the handler's next call fails, before the transaction needs the lock
                wait_until(failed_once.is_set, what="the handler's failure")
            wait_until(lambda: stored_offsets(engine, "shipping") == {0: 2}, what="the second offset")
    finally:
        engine.dispose()
    outcomes = [o for m, o, _ in source.taken if m == "second"]
    assert outcomes[-1] == "handled" and set(outcomes[:-1]) == {None}
    assert seen[0] == 1 and set(seen[1:]) == {2}  # the database's failures were not counted
    assert [row.message_id for row in effects(engine)] == ["first", "second"]


def test_undecodable_records_become_dead_letters_with_their_offsets(db, cluster):
    engine, sessions = db
    produce(
        cluster,
        [
            (0, {"ce-id": "bad-json", "ce-type": EVENT}, b"not json"),
            (0, {"ce-id": "no-type"}, b"{}"),
            (0, {"ce-type": EVENT}, b'{"foreign": true}'),  # no ce-id: its place in the log names it
            (0, *event("after", {})),
        ],
    )
    inbox, source = kafka_inbox(cluster)
    with serving(Consumer(inbox, sessions)):
        wait_until(lambda: stored_offsets(engine, "shipping") == {0: 4}, what="the four offsets")
    assert [(m, o) for m, o, _ in source.taken] == [
        ("bad-json", "refused"),
        ("no-type", "refused"),
        (f"{TOPIC}/0/2", "handled"),
        ("after", "handled"),
    ]
    with engine.connect() as conn:
        dead = {row.message_id: row for row in conn.execute(select(dead_letters))}
    assert set(dead) == {"bad-json", "no-type"}
    assert "not JSON" in dead["bad-json"].error and "no ce-type" in dead["no-type"].error
    assert [row.message_id for row in effects(engine)] == [f"{TOPIC}/0/2", "after"]


# -- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        ({"enable.auto.commit": True}, "'enable.auto.commit' must stay false"),
        ({"enable.auto.commit": "true"}, "'enable.auto.commit' must stay false"),
        ({"enable.auto.offset.store": True}, "'enable.auto.offset.store' must stay false"),
        ({"isolation.level": "read_uncommitted"}, "aborted"),
        ({"auto.offset.reset": "error"}, "'earliest' or 'latest'"),
        ({"group.id": "other"}, "group_id"),
        ({"bootstrap.servers": "127.0.0.1:9"}, "bootstrap_servers"),
        ({"on_commit": print}, "lag"),
        ({"error_cb": print}, "client errors"),
        ({"no.such.property": "1"}, "invalid Kafka consumer config"),
        ({"session.timeout.ms": "soon"}, "invalid Kafka consumer config"),
    ],
)
def test_bad_configuration_is_refused_at_construction(config, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        KafkaConsumer("127.0.0.1:9", TOPIC, "g", config=config)


@pytest.mark.parametrize(
    ("arguments", "options", "complaint"),
    [
        (("", TOPIC, "g"), {}, "bootstrap_servers"),
        (("127.0.0.1:9", [], "g"), {}, "topics"),
        (("127.0.0.1:9", "not a topic", "g"), {}, "not a Kafka topic name"),
        (("127.0.0.1:9", "^orders.*", "g"), {}, "patterns are not supported"),
        (("127.0.0.1:9", [TOPIC, TOPIC], "g"), {}, "twice"),
        (("127.0.0.1:9", TOPIC, ""), {}, "group_id"),
        (("127.0.0.1:9", TOPIC, "g"), {"name": ""}, "name"),
        (("127.0.0.1:9", TOPIC, "g"), {"poll_timeout": 0}, "poll_timeout"),
        (("127.0.0.1:9", TOPIC, "g"), {"poll_timeout": True}, "poll_timeout"),
        (("127.0.0.1:9", TOPIC, "g"), {"commit_to_kafka": "yes"}, "commit_to_kafka"),
    ],
)
def test_bad_arguments_are_refused_at_construction(arguments, options, complaint):
    with pytest.raises(ConfigurationError, match=complaint):
        KafkaConsumer(*arguments, **options)


def test_secrets_in_the_config_never_appear_in_errors():
    with pytest.raises(ConfigurationError) as refused:
        KafkaConsumer(
            "127.0.0.1:9",
            TOPIC,
            "g",
            config={"sasl.password": "hunter2-secret", "security.protocol": "hunter2-secret"},
        )
    assert "hunter2" not in str(refused.value)
    source = KafkaConsumer("127.0.0.1:9", TOPIC, "g", config={"sasl.password": "hunter2-secret"})
    assert "hunter2" not in repr(source) and source.name == "kafka:g"


@sqlite_only
def test_a_missing_topic_stops_the_consumer_with_one_line(db, cluster):
    _, sessions = db
    inbox = Inbox("shipping")
    inbox.handler("#", name="apply")(kafka_inbox_app.apply)
    inbox.consume(KafkaConsumer(cluster.bootstrap_servers, "no-such-topic", "shipping"))
    with pytest.raises(ConfigurationError, match="Kafka topic 'no-such-topic' does not exist"):
        Consumer(inbox, sessions).run()


@sqlite_only
def test_one_inbox_reading_a_topic_through_two_groups_is_refused(db, cluster):
    _, sessions = db
    inbox = Inbox("shipping")
    inbox.handler("#", name="apply")(kafka_inbox_app.apply)
    inbox.consume(
        KafkaConsumer(cluster.bootstrap_servers, TOPIC, "one"),
        KafkaConsumer(cluster.bootstrap_servers, TOPIC, "two"),
    )
    with pytest.raises(ConfigurationError, match="different groups"):
        Consumer(inbox, sessions).run()


def test_the_guides_kafka_example_takes_a_published_order_and_stops_on_sigterm(tmp_path: Path, cluster):
    guide = (Path(__file__).resolve().parents[1] / "docs" / "inbox.md").read_text()
    scripts = dict(re.findall(r"```python\n# file: (\S+)\n(.*?)```", guide, re.S))
    found = re.search(r"\n### Kafka\n.*?```python\n(# consume_kafka\.py.*?)```", guide, re.S)
    assert found is not None and "shipping.py" in scripts
    assert found.group(1).count('"127.0.0.1:9092"') == 1
    (tmp_path / "shipping.py").write_text(scripts["shipping.py"])
    (tmp_path / "consume_kafka.py").write_text(
        found.group(1).replace('"127.0.0.1:9092"', repr(cluster.bootstrap_servers))
    )
    log = tmp_path / "consume_kafka.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "consume_kafka.py"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=relay_env(),
        )
    try:
        # shipping.py makes its database afresh at import: only then is it ours to read.
        wait_until(
            lambda: "event emitted" in log.read_text() or proc.poll() is not None, what="shipping.py run"
        )
        assert proc.poll() is None, log.read_text()
        produce(cluster, [(1, *event("order-42", {"order_id": 42}))])
        engine = create_engine(f"sqlite:///{tmp_path / 'shipping.db'}")
        try:

            def shipped() -> bool:
                with engine.connect() as conn:
                    return 42 in conn.scalars(text("SELECT order_id FROM shipments")).all()

            wait_until(shipped, timeout=60, what=f"order 42 shipped\n{log.read_text()}")
            assert stored_offsets(engine, "shipping") == {1: 1}
        finally:
            engine.dispose()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_librdkafka_repeating_an_error_is_logged_once_then_counted(caplog, monkeypatch):
    """While a broker refuses connections librdkafka logs every attempt: the log keeps one a minute."""
    logger = _kafka_session.Logger(Redactor(["s3cret"]))

    def refused(attempt: int) -> None:
        text = f"127.0.0.1:{40000 + attempt}: Connect failed: Connection refused (after {attempt}ms) s3cret"
        logger.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", text)

    with caplog.at_level(logging.DEBUG, logger="outbox.integrations.kafka.librdkafka"):
        for attempt in range(100):
            refused(attempt)
        logger.log(logging.DEBUG, "%s", "asked for: every line passes")
        logger.log(logging.DEBUG, "%s", "asked for: every line passes")
        monkeypatch.setattr(_kafka_session, "ERROR_LOG_INTERVAL", 0.0)  # the minute is over
        refused(100)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and not any("s3cret" in e for e in errors)
    assert errors[1].endswith("(99 more like this in the last 0s not logged)")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == [
        "asked for: every line passes"
    ] * 2
