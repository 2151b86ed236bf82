"""Publish to Kafka with confluent-kafka: an idempotent producer, ``acks=all``, the delivery report awaited.

::

    from outbox.integrations.kafka import KafkaPublisher

    ob.route(
        "order.paid",
        KafkaPublisher({"bootstrap.servers": "kafka-1:9092,kafka-2:9092"}, topic="orders.{event_type}"),
        name="orders_kafka",
    )

Each message is produced with the CloudEvents envelope (``ce-*`` Kafka
headers, the JSON payload as value) keyed by its aggregate id, and the handler
returns only once the broker acknowledged the write on every in-sync replica:
the attempt is recorded delivered after Kafka has the message, never before.
What the delivery report says decides the rest:

=========================================  =====================================================
acknowledged                               delivered; the detail records topic, partition, offset
the message itself can never be written    dead at once, the broker's reason recorded
(too large, invalid record, invalid topic)
anything else: brokers away, not enough    retried with the route's backoff (librdkafka has
in-sync replicas, unknown topic,           already retried inside ``delivery_timeout``); a
authorization, a fatal producer error      fatal error also replaces the producer
no report within ``delivery_timeout``      retried, never a hang
=========================================  =====================================================

An unknown topic and a refused authorization are retried, not dead: both are
fixed on the cluster (create the topic, grant the ACL), often by a deploy that
has not finished yet, and the message is still good. ``max_attempts`` bounds
the wait; a message dead after it can be requeued once the cluster is fixed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, NoReturn

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox import ConfigurationError, Message, PermanentError, RetryLater
from outbox._redact import Redactor

from ._envelope import envelope
from ._kafka_config import (
    TOPIC_NAME,
    check_topic_template,
    producer_config,
    secret_values,
    validate_with_librdkafka,
)

__all__ = ["KafkaPublisher"]

log = logging.getLogger("outbox.integrations.kafka")
_librdkafka_log = logging.getLogger("outbox.integrations.kafka.librdkafka")

#: The wait for a delivery report beyond ``delivery_timeout``: librdkafka fails a message itself
#: at ``message.timeout.ms`` (set to ``delivery_timeout``); this only catches a report that never comes.
REPORT_GRACE = 2.0
#: librdkafka's errors (other than a fatal one) are logged at most this often per kind.
ERROR_LOG_INTERVAL = 60.0

# Errors about the message itself: sending the same bytes to the same topic again cannot succeed.
_PERMANENT = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,  # local (message.max.bytes) and broker (max.message.bytes)
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.INVALID_MSG,  # CORRUPT_MESSAGE
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,  # an invalid topic name
        KafkaError.INVALID_TIMESTAMP,
        KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
        KafkaError._INVALID_ARG,
    }
)
# Errors librdkafka remembers for the topic until its next metadata refresh (every 5 minutes by
# default): every retry until then would be refused locally, so a refresh is asked for at once.
#: The brokers cannot be reached or cannot take writes right now: nothing is known about the message,
#: so the deferral uses up no attempt (a broker outage of any length kills no message).
UNAVAILABLE = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._RESOLVE,
        KafkaError.BROKER_NOT_AVAILABLE,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    }
)
#: How long a message deferred by unavailable brokers waits: the producer reconnects meanwhile.
UNAVAILABLE_RETRY = 2.0

_TOPIC_STATE = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError.LEADER_NOT_AVAILABLE,
    }
)


class _Logger:
    """What confluent-kafka's ``logger`` needs (a ``log`` method), masking secrets on the way."""

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if _librdkafka_log.isEnabledFor(level):
            try:
                text = fmt % args if args else str(fmt)
            except (TypeError, ValueError):
                text = " ".join(map(str, (fmt, *args)))
            _librdkafka_log.log(level, "%s", self._redactor.text(text))


class _Session:
    """One producer and the one thread that serves its delivery reports, for one relay (event loop).

    ``poll()`` blocks, so it runs on a thread of its own; each report settles
    its message's future on the loop that produced it, thread-safely.
    """

    def __init__(self, config: dict[str, Any], redactor: Redactor) -> None:
        self.fatal: KafkaError | None = None
        self._redactor = redactor
        self._logged: dict[int, float] = {}
        self._refreshing: dict[str, threading.Thread] = {}
        self._refresh_lock = threading.Lock()
        self.producer = Producer({**config, "error_cb": self._on_error, "logger": _Logger(redactor)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="outbox-kafka-reports", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.producer.poll(0.1)  # returns at once when a report is ready
            except KafkaException as exc:  # how confluent-kafka raises a fatal error
                if exc.args and isinstance(exc.args[0], KafkaError):
                    self._on_error(exc.args[0])
            except Exception:  # never let the thread end: every waiting attempt would time out
                log.exception("Kafka delivery report handling failed")

    def _on_error(self, err: KafkaError) -> None:
        """Client-level errors (brokers down, authentication); each message's fate is in its own report."""
        text = self._redactor.text(err.str())
        if err.fatal():
            self.fatal = err  # the idempotent producer cannot go on: the next message gets a new one
            log.error("Kafka producer failed fatally (%s): %s; it will be replaced", err.name(), text)
            return
        now = time.monotonic()
        if now - self._logged.get(err.code(), -math.inf) >= ERROR_LOG_INTERVAL:
            self._logged[err.code()] = now
            log.warning("Kafka client error %s: %s", err.name(), text)

    def refresh(self, topic: str) -> None:
        """Fetch ``topic``'s metadata in the background, so the next attempt sees the cluster as it is now."""
        with self._refresh_lock:
            if topic in self._refreshing or self._stop.is_set():
                return
            thread = self._refreshing[topic] = threading.Thread(
                target=self._refresh, args=(topic,), name="outbox-kafka-metadata", daemon=True
            )
        thread.start()

    def _refresh(self, topic: str) -> None:
        try:
            self.producer.list_topics(topic, timeout=5)
        except Exception as exc:  # the cluster is away: the next attempt's own error tells
            log.debug("Kafka metadata refresh for %s failed: %s", topic, self._redactor.text(str(exc)))
        finally:
            with self._refresh_lock:
                self._refreshing.pop(topic, None)

    def close(self, timeout: float) -> int:
        """Stop the report thread, wait up to ``timeout`` for what is in flight; how many were left."""
        self._stop.set()
        self._thread.join()
        with self._refresh_lock:
            refreshing = list(self._refreshing.values())
        for thread in refreshing:  # the producer must outlive their requests
            thread.join()
        left = self.producer.flush(timeout)
        if left:
            self.producer.purge()  # their attempts have already timed out and will be retried
            self.producer.poll(0)
        self.producer.close()
        return left


def _report(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[tuple[KafkaError | None, int, int]],
    err: KafkaError | None,
    msg: Any,
) -> None:
    """The delivery callback, on the report thread: hand the outcome to the waiting coroutine."""
    outcome = (err, msg.partition(), msg.offset())

    def settle() -> None:
        if not future.done():  # the attempt may have timed out or been cancelled meanwhile
            future.set_result(outcome)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


class KafkaPublisher:
    """Produce each message to the topic ``topic`` names, and return once Kafka has acknowledged it.

    ``config`` is confluent-kafka's producer configuration (``bootstrap.servers``
    and any security settings). ``enable.idempotence=true`` and ``acks=all``
    are forced, and refused if set otherwise: without them an acknowledged
    message can still be lost when a leader fails, or written twice when
    librdkafka retries. ``message.timeout.ms`` defaults to ``delivery_timeout``
    (and may not exceed it, or a message the relay has given up on could
    still be written after the retry). ``partitioner`` defaults to
    ``murmur2_random``, Java's, so a key lands on the same partition as it
    does from Java producers.

    ``topic`` is a template over ``{event_type}``, ``{aggregate_type}``,
    ``{aggregate_id}`` and ``{handler}``; ``source`` is the ``ce-source``
    attribute. One producer is created per relay, at its first message, and
    flushed and closed when the relay stops.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topic: str = "{event_type}",
        *,
        source: str = "urn:sqlalchemy-outbox:{handler}",
        delivery_timeout: float = 30.0,
    ) -> None:
        if (
            isinstance(delivery_timeout, bool)
            or not isinstance(delivery_timeout, int | float)
            or not math.isfinite(delivery_timeout)
            or delivery_timeout < 1
        ):
            # A new idempotent producer needs its producer id before the first write: half a second or so.
            raise ConfigurationError(
                f"delivery_timeout must be a number of seconds >= 1, got {delivery_timeout!r}"
            )
        if not isinstance(source, str) or not source:
            raise ConfigurationError("source must be a non-empty string (the ce-source attribute)")
        self.topic = check_topic_template(topic)
        self.source = source
        self.delivery_timeout = float(delivery_timeout)
        self._config = producer_config(config, self.delivery_timeout)
        self._redactor = Redactor(self.outbox_secrets())
        validate_with_librdkafka(self._config, self._redactor)
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Session] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        servers = self._config.get("bootstrap.servers", "mock")
        return f"<KafkaPublisher {servers} topic={self.topic.template!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """Config values the relay masks wherever they would be written (passwords, keys, OAuth config)."""
        return secret_values(self._config)

    async def outbox_shutdown(self) -> None:
        """Flush and close this relay's producer (the relay calls this when it stops)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.pop(loop, None)
            replaced = [task for task in self._closing if task.get_loop() is loop]
        if session is not None:
            await self._close(session)
        await asyncio.gather(*replaced)  # producers replaced after a fatal error, still closing

    async def _close(self, session: _Session) -> None:
        left = await asyncio.to_thread(session.close, self.delivery_timeout)
        if left:
            log.warning(
                "Kafka producer closed with %d message(s) unacknowledged; their attempts are retried", left
            )

    # -- delivery -----------------------------------------------------------------------

    def _session(self) -> _Session:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is not None and session.fatal is None:
                return session
            if session is not None:  # fenced or otherwise dead: its messages were all failed already
                task = loop.create_task(self._close(session))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            session = self._sessions[loop] = _Session(self._config, self._redactor)
            return session

    def _topic_of(self, message: Message) -> str:
        topic = self.topic.render(message)
        if not TOPIC_NAME.match(topic) or topic in (".", ".."):
            raise PermanentError(
                f"topic {topic[:300]!r} (from {self.topic.template!r}) is not a legal Kafka topic name",
                detail={"reason": "bad_topic", "topic": topic[:300]},
            )
        return topic

    async def __call__(self, message: Message) -> dict[str, Any]:
        topic = self._topic_of(message)
        env = envelope(message, source=self.source)
        session = self._session()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[KafkaError | None, int, int]] = loop.create_future()
        try:
            session.producer.produce(
                topic,
                value=env.body,
                key=None if env.key is None else env.key.encode(),
                headers=[(name, value.encode()) for name, value in env.headers.items()],
                on_delivery=functools.partial(_report, loop, future),
            )
        except BufferError:
            raise RetryLater(
                "the Kafka producer's local queue is full; not counted",
                delay=UNAVAILABLE_RETRY,
                counts_as_attempt=False,
                detail={"reason": "queue_full", "topic": topic},
            ) from None
        except KafkaException as exc:
            self._refused(exc.args[0], topic, session)
        try:
            async with asyncio.timeout(self.delivery_timeout + REPORT_GRACE):
                err, partition, offset = await future
        except TimeoutError:
            raise RetryLater(
                f"no delivery report from Kafka within {self.delivery_timeout:g}s "
                "(brokers unreachable or not taking writes); not counted",
                delay=UNAVAILABLE_RETRY,
                counts_as_attempt=False,
                detail={"reason": "timeout", "topic": topic},
            ) from None
        if err is not None:
            self._refused(err, topic, session)
        return {"topic": topic, "partition": partition, "offset": offset}

    def _refused(self, err: object, topic: str, session: _Session) -> NoReturn:
        if not isinstance(err, KafkaError):
            raise RetryLater(f"Kafka producer error: {err}", detail={"topic": topic})
        detail = {"topic": topic, "error": err.name()}
        text = f"Kafka did not take the message for {topic}: {err.name()}: {err.str()}"
        if err.fatal() or err.code() == KafkaError._FATAL or session.fatal is not None:
            session.fatal = session.fatal or err
            raise RetryLater(text, detail={**detail, "reason": "fatal"})
        if err.code() in _PERMANENT:
            raise PermanentError(text, detail=detail)
        if err.code() in _TOPIC_STATE:
            session.refresh(topic)
        if err.code() in UNAVAILABLE:
            raise RetryLater(
                f"{text}; not counted",
                delay=UNAVAILABLE_RETRY,
                counts_as_attempt=False,
                detail={**detail, "reason": "unavailable"},
            )
        raise RetryLater(text, detail=detail)
