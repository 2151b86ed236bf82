"""The Kafka source's consumer thread: the one thread that touches the ``confluent_kafka.Consumer``.

``poll()`` blocks, and librdkafka runs the rebalance callbacks inside it, so
one thread owns the consumer: it polls, hands records to the loop in
batches, pauses and resumes partitions as the loop asks, commits lag
positions to Kafka, and answers rebalances.

A rebalance needs the loop (the offsets stored in the database; the record
in hand of a revoked partition), so the callback waits for the loop's answer
right there: librdkafka fetches nothing for a partition until the callback
has assigned it, with the stored offset as its start, and hands a revoked
partition on only once the callback returns. Records fetched before a
rebalance are handed to the loop before the rebalance is, so they reach the
assignment they were fetched for, and are dropped with it.

Readiness: librdkafka reports every broker down (``_ALL_BROKERS_DOWN``) but
says nothing when one is back, so while they are down the thread asks for
metadata once a second, and the first answer makes the source ready again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from outbox import ConfigurationError
from outbox._first_line import first_line
from outbox._inbox.source import SourceContext
from outbox._redact import Redactor

from ._broker_recovery import PROBE_INTERVAL
from ._kafka_partitions import Key, Partitions
from ._kafka_session import ERROR_LOG_INTERVAL, Logger

__all__ = ["COMMIT_INTERVAL", "Poller"]

log = logging.getLogger("outbox.integrations.kafka")
T = TypeVar("T")

#: Records handed to the loop at once, at most.
BATCH = 500
#: Seconds between the lag commits to Kafka.
COMMIT_INTERVAL = 1.0
#: Seconds the start-up metadata request may take before the start counts as failed (and is retried).
STARTUP_TIMEOUT = 10.0
#: Longest pause between two reads of the stored offsets that failed during an assignment.
STORED_RETRY_MAX = 5.0
_MISSING = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})


def _keys(partitions: Iterable[TopicPartition]) -> list[Key]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _shown(positions: dict[Key, int | None]) -> str:
    return ", ".join(
        f"{topic}[{number}] at {'the reset position' if offset is None else offset}"
        for (topic, number), offset in sorted(positions.items())
    )


class Poller:
    """One consumer and the thread that owns it, for one run of a source."""

    def __init__(
        self,
        *,
        name: str,
        config: dict[str, Any],
        topics: tuple[str, ...],
        cooperative: bool,
        start: int,
        context: SourceContext,
        partitions: Partitions,
        redactor: Redactor,
        poll_timeout: float,
        commit_to_kafka: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._name = name
        self._config = config
        self._topics = topics
        self._cooperative = cooperative
        self._start = start
        self._context = context
        self._partitions = partitions
        self._redactor = redactor
        self._poll_timeout = poll_timeout
        self._commit_to_kafka = commit_to_kafka
        self._loop = loop
        #: Set on the loop when the thread has closed the consumer (its exception, if it failed).
        self.finished: asyncio.Future[None] = loop.create_future()
        self._stop = threading.Event()
        self._abandoned = threading.Event()
        self._failure: BaseException | None = None
        self._pending: list[Any] = []  # fetched, not yet handed to the loop
        self._paused: set[Key] = set()
        self._sent: dict[Key, int] = {}
        self._away = False
        self._logged: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="outbox-kafka-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Fetch nothing more; close the consumer (its revocation waits for the records in hand)."""
        self._stop.set()

    def abandon(self) -> None:
        """Stop without waiting for the loop any more (it is being cancelled)."""
        self._abandoned.set()
        self._stop.set()

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        consumer: Consumer | None = None
        try:
            consumer = Consumer(
                {
                    **self._config,
                    "error_cb": self._on_error,
                    "logger": Logger(self._redactor),
                    "on_commit": self._on_commit,
                }
            )
            self._check_topics(consumer)
            self._tell(self._context.connected, True)
            consumer.subscribe(
                list(self._topics),
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._serve(consumer)
        except BaseException as exc:  # handed to the loop: consume() raises it
            self._failure = self._failure or exc
        finally:
            if consumer is not None:
                try:
                    consumer.close()  # revokes what is assigned: the callback waits for records in hand
                except Exception as exc:
                    log.warning("source %s: closing the Kafka consumer failed: %s", self._name, exc)
            self._finish()

    def _finish(self) -> None:
        failure = self._failure

        def settle() -> None:
            if self.finished.done():
                return
            if failure is None:
                self.finished.set_result(None)
            else:
                self.finished.set_exception(failure)

        self._tell(settle)

    def _check_topics(self, consumer: Consumer) -> None:
        """Each topic exists and may be read; a cluster that does not answer is a retry, not an error."""
        for topic in self._topics:
            found = consumer.list_topics(topic, timeout=STARTUP_TIMEOUT).topics.get(topic)
            error = None if found is None else found.error
            if found is None or (error is not None and error.code() in _MISSING):
                raise ConfigurationError(f"Kafka topic {topic!r} does not exist: create it, then start again")
            if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                raise ConfigurationError(
                    f"group {self._config['group.id']!r} may not read Kafka topic {topic!r}"
                )
            if error is not None:
                raise KafkaException(error)

    def _serve(self, consumer: Consumer) -> None:
        next_commit = time.monotonic() + COMMIT_INTERVAL
        next_probe = 0.0
        while not self._stop.is_set():
            if self._failure is not None:
                raise self._failure
            if self._partitions.changed.is_set():
                self._apply_pauses(consumer)
            now = time.monotonic()
            if self._away and now >= next_probe:
                next_probe = now + PROBE_INTERVAL
                self._probe(consumer)
            if self._commit_to_kafka and now >= next_commit:
                next_commit = now + COMMIT_INTERVAL
                self._commit(consumer, self._partitions.committed())
            # poll(), never consume(): a rebalance callback must find every record fetched
            # before it in _pending, to hand them over first (see _flush).
            record = consumer.poll(self._poll_timeout)
            while record is not None:
                if self._is_record(record):
                    self._pending.append(record)
                if len(self._pending) >= BATCH:
                    break
                record = consumer.poll(0)
            self._flush()

    def _is_record(self, record: Any) -> bool:
        error = record.error()
        if error is None:
            return True
        if error.code() == KafkaError._PARTITION_EOF:
            return False
        if error.fatal():
            raise KafkaException(error)
        self._warn(error, f"{record.topic() or ''}[{record.partition()}]")
        return False

    def _flush(self) -> None:
        if self._pending:
            records, self._pending = self._pending, []
            self._tell(self._partitions.arrived, records)

    # -- talking to the loop ----------------------------------------------------------------------

    def _tell(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _ask(self, make: Callable[[], Awaitable[T]]) -> T | None:
        """Run a coroutine on the loop and wait for its answer; None if the loop is gone or going."""
        if self._abandoned.is_set():
            return None

        async def run() -> T:
            return await make()

        try:
            future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        except RuntimeError:
            return None
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self._abandoned.is_set():
                    future.cancel()
                    return None
            except concurrent.futures.CancelledError:
                return None

    # -- rebalances -------------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        try:
            self._flush()
            self._assign(consumer, partitions)
        except Exception as exc:  # never let librdkafka assign by itself: it would start elsewhere
            self._failure = self._failure or exc
            self._assign_idle(consumer, partitions)

    def _assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        stored = self._stored_offsets({tp.topic for tp in partitions})
        if stored is None:  # stopping before the database answered
            self._assign_idle(consumer, partitions)
            return
        positions = {key: stored[key[0]].get(key[1]) for key in _keys(partitions)}
        self._ask(lambda: self._partitions.assign(positions))
        starts = [
            TopicPartition(topic, number, self._start if offset is None else offset)
            for (topic, number), offset in positions.items()
        ]
        if self._cooperative:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        consumer.resume(starts)  # a partition paused under an earlier assignment starts afresh
        self._paused.difference_update(positions)
        self._sent.update({key: offset for key, offset in positions.items() if offset is not None})
        log.info(
            "source %s assigned %s",
            self._name,
            _shown(positions),
            extra={"action": "kafka_assigned", "source": self._name},
        )

    def _assign_idle(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Assign, as librdkafka requires, but fetch nothing: the loop does not know these partitions."""
        idle = [TopicPartition(tp.topic, tp.partition, OFFSET_END) for tp in partitions]
        try:
            if self._cooperative:
                consumer.incremental_assign(idle)
            else:
                consumer.assign(idle)
            consumer.pause(idle)
            self._paused.update(_keys(idle))
        except Exception as exc:
            self._failure = self._failure or exc

    def _stored_offsets(self, topics: set[str]) -> dict[str, dict[int, int]] | None:
        """``{topic: {partition: next offset}}`` from the database, retried until it answers."""
        found: dict[str, dict[int, int]] = {}
        for topic in sorted(topics):
            delay = 0.5
            while topic not in found:
                if self._stop.is_set():
                    return None
                try:
                    offsets = self._ask(lambda topic=topic: self._context.stored_offsets(topic))  # type: ignore[misc]
                except Exception as exc:
                    log.warning(
                        "source %s: cannot read the stored offsets of %s: %s; trying again in %.1fs",
                        self._name,
                        topic,
                        first_line(exc),
                        delay,
                        extra={"action": "kafka_offsets_unread", "source": self._name},
                    )
                    self._stop.wait(delay)
                    delay = min(delay * 2, STORED_RETRY_MAX)
                    continue
                if offsets is None:
                    return None
                found[topic] = offsets
        return found

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=False)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._give_up(consumer, partitions, lost=True)

    def _give_up(self, consumer: Consumer, partitions: list[TopicPartition], *, lost: bool) -> None:
        keys = _keys(partitions)
        try:
            self._flush()
            committed = self._ask(lambda: self._partitions.revoke(keys)) or {}
            if self._commit_to_kafka and not lost:
                self._commit(consumer, committed)
        except Exception as exc:
            self._failure = self._failure or exc
        finally:
            try:
                if self._cooperative:
                    consumer.incremental_unassign(partitions)
                else:
                    consumer.unassign()
            except Exception as exc:
                self._failure = self._failure or exc
            self._paused.difference_update(keys)
            for key in keys:
                self._sent.pop(key, None)
        log.info(
            "source %s %s %s",
            self._name,
            "lost" if lost else "handed back",
            ", ".join(f"{topic}[{number}]" for topic, number in sorted(keys)),
            extra={"action": "kafka_lost" if lost else "kafka_revoked", "source": self._name},
        )

    # -- pauses, lag commits, errors, readiness ---------------------------------------------------

    def _apply_pauses(self, consumer: Consumer) -> None:
        self._partitions.changed.clear()
        wanted = self._partitions.pauses()
        pause = [key for key, want in wanted.items() if want and key not in self._paused]
        resume = [key for key, want in wanted.items() if not want and key in self._paused]
        if pause:
            consumer.pause([TopicPartition(topic, number) for topic, number in pause])
            self._paused.update(pause)
        if resume:
            consumer.resume([TopicPartition(topic, number) for topic, number in resume])
            self._paused.difference_update(resume)

    def _commit(self, consumer: Consumer, committed: dict[Key, int]) -> None:
        """Tell Kafka how far the database is, for lag tools; never read back (the database is the truth)."""
        ahead = {key: offset for key, offset in committed.items() if offset > self._sent.get(key, -1)}
        if not ahead:
            return
        try:
            consumer.commit(
                offsets=[TopicPartition(topic, number, offset) for (topic, number), offset in ahead.items()],
                asynchronous=True,
            )
        except KafkaException as exc:
            log.debug("source %s: lag commit to Kafka failed: %s", self._name, exc)
            return
        self._sent.update(ahead)

    def _on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        if error is not None:
            log.debug("source %s: lag commit to Kafka failed: %s", self._name, error.str())

    def _on_error(self, error: KafkaError) -> None:
        """Client-level errors: every broker down (readiness), a fatal one (start again), the rest logged."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN and not self._away:
            self._away = True
            self._tell(self._context.connected, False)
        if error.fatal():
            self._failure = self._failure or KafkaException(error)
            return
        self._warn(error, "client")

    def _warn(self, error: KafkaError, where: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(error.code(), -math.inf) >= ERROR_LOG_INTERVAL:
            self._logged[error.code()] = now
            log.warning(
                "source %s: Kafka %s error %s: %s",
                self._name,
                where,
                error.name(),
                self._redactor.text(error.str()),
                extra={"action": "kafka_error", "source": self._name},
            )

    def _probe(self, consumer: Consumer) -> None:
        try:
            consumer.list_topics(self._topics[0], timeout=PROBE_INTERVAL)
        except KafkaException:
            return  # still down: librdkafka reconnects meanwhile
        self._away = False
        self._tell(self._context.connected, True)
        log.info(
            "source %s: Kafka answers again", self._name, extra={"action": "kafka_back", "source": self._name}
        )
