"""The Kafka source's consumer thread: the one thread that touches the ``confluent_kafka.Consumer``.

``poll()`` blocks, and librdkafka runs the rebalance callbacks inside it, so
one thread owns the consumer: it polls, hands records to the loop in
batches, and leaves rebalances, pauses and lag commits to its
:class:`~._kafka_assignment.Assignment`. Only ``poll()`` fetches, never
``consume()``: a rebalance callback must find every record fetched before it
still here, to hand them over first.

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
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException

from outbox import ConfigurationError
from outbox._inbox.source import SourceContext
from outbox._redact import Redactor

from ._broker_recovery import PROBE_INTERVAL
from ._kafka_assignment import Assignment
from ._kafka_partitions import Partitions
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
_MISSING = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})


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
        self._assignment = Assignment(
            name=name,
            context=context,
            partitions=partitions,
            cooperative=cooperative,
            start=start,
            commit_to_kafka=commit_to_kafka,
            ask=self._ask,
            flush=self._flush,
            stop=self._stop,
            fail=self._fail,
        )
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
                    "on_commit": self._assignment.on_commit,
                }
            )
            self._check_topics(consumer)
            self._tell(self._context.connected, True)
            assignment = self._assignment
            consumer.subscribe(
                list(self._topics),
                on_assign=assignment.on_assign,
                on_revoke=assignment.on_revoke,
                on_lost=assignment.on_lost,
            )
            self._serve(consumer)
        except BaseException as exc:  # handed to the loop: consume() raises it
            self._fail(exc)
        finally:
            if consumer is not None:
                self._close(consumer)
            self._finish()
        # The consumer is destroyed as this returns, after the loop was told: with every broker
        # down, that may wait for requests nobody will answer, and only this thread waits.

    def _close(self, consumer: Consumer) -> None:
        """Leave the group, which revokes what is assigned (the callback waits for the records in hand).

        With every broker down, leaving would wait for the coordinator until
        ``session.timeout.ms`` (45 s by default), past a stop's grace period:
        the consumer is then dropped without leaving, and the group notices
        when the session runs out. consume() still waits for the records in
        hand, and each partition's next owner starts at its stored offset.
        """
        if self._away:
            log.info(
                "source %s: every broker is down: the consumer is dropped without leaving its group",
                self._name,
                extra={"action": "kafka_dropped", "source": self._name},
            )
            return
        try:
            consumer.close()
        except Exception as exc:
            log.warning("source %s: closing the Kafka consumer failed: %s", self._name, exc)

    def _fail(self, exc: BaseException) -> None:
        """The first failure wins: it is what consume() raises, once the consumer is closed."""
        self._failure = self._failure or exc

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
                self._assignment.apply_pauses(consumer)
            now = time.monotonic()
            if self._away and now >= next_probe:
                next_probe = now + PROBE_INTERVAL
                self._probe(consumer)
            if self._commit_to_kafka and now >= next_commit:
                next_commit = now + COMMIT_INTERVAL
                self._assignment.commit(consumer, self._partitions.committed())
            # poll(), never consume(): see the module's docstring.
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

    # -- errors and readiness ----------------------------------------------------------------------

    def _on_error(self, error: KafkaError) -> None:
        """Client-level errors: every broker down (readiness), a fatal one (start again), the rest logged."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN and not self._away:
            self._away = True
            self._tell(self._context.connected, False)
        if error.fatal():
            self._fail(KafkaException(error))
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
