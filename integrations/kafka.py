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
brokers unreachable or not taking writes   deferred, not counted; while every broker is down,
(``UNAVAILABLE``)                          parked until one is back
anything else: unknown topic,              retried with the route's backoff (librdkafka has
authorization, a fatal producer error      already retried inside ``delivery_timeout``); a
                                           fatal error also replaces the producer
no report within ``delivery_timeout``      retried, never a hang; not counted
=========================================  =====================================================

While librdkafka reports every broker down, messages are parked on the
cluster (``_broker_recovery``, keyed ``kafka://`` and the bootstrap servers)
without being produced, and a probe asks for the cluster's metadata once a
second (``_kafka_session``); its first answer sends every parked message at
once, in every relay. librdkafka reconnects meanwhile, at most a second apart
(``reconnect.backoff.max.ms`` defaults to 1000 here), and a message it still
holds from before the outage goes out as soon as it has.

The relay hands the publisher a claim's messages at once
(``outbox_deliver_batch``): all of them are produced first, so librdkafka
batches them on the wire, and their delivery reports are awaited together,
under one ``delivery_timeout``. Each report decides its own message's outcome;
a batch claimed while every broker is down is parked whole, none of it produced.

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
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException

from outbox import ConfigurationError, Message, PermanentError, RetryLater, Route
from outbox._redact import Redactor

from ._broker_recovery import Recovery
from ._envelope import envelope
from ._kafka_config import (
    TOPIC_NAME,
    check_topic_template,
    producer_config,
    secret_values,
    validate_with_librdkafka,
)
from ._kafka_consumer import KafkaConsumer
from ._kafka_session import Report, Session

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

__all__ = ["KafkaConsumer", "KafkaPublisher"]

log = logging.getLogger("outbox.integrations.kafka")

#: The wait for a delivery report beyond ``delivery_timeout``: librdkafka fails a message itself
#: at ``message.timeout.ms`` (set to ``delivery_timeout``); this only catches a report that never comes.
REPORT_GRACE = 2.0

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
    flushed and closed when the relay stops. ``delivery_timeout`` (25 s) stays
    below the route's timeout (30 s by default) with its grace, so librdkafka's
    verdict comes first: a route whose timeout is shorter is warned about at
    start (``kafka_timeout_short``), since its cut-off counts an attempt where
    the verdict would have said the brokers were away.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topic: str = "{event_type}",
        *,
        source: str = "urn:sqlalchemy-outbox:{handler}",
        delivery_timeout: float = 25.0,
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
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Session] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._closing: set[asyncio.Task[None]] = set()
        servers = str(self._config.get("bootstrap.servers") or "mock")
        self._recovery = Recovery(f"kafka://{servers}", f"Kafka at {servers}")

    @property
    def destination(self) -> str:
        """What a message is parked on while every broker is down: ``kafka://`` and the bootstrap servers."""
        return self._recovery.destination

    def __repr__(self) -> str:
        servers = self._config.get("bootstrap.servers", "mock")
        return f"<KafkaPublisher {servers} topic={self.topic.template!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """Config values the relay masks wherever they would be written (passwords, keys, OAuth config)."""
        return secret_values(self._config)

    def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
        """Warn when the route's timeout would cut a delivery report short (a counted attempt)."""
        if route.timeout <= self.delivery_timeout + REPORT_GRACE:
            log.warning(
                "route %s: its timeout (%gs) ends an attempt before Kafka's delivery report can come "
                "(delivery_timeout %gs plus %gs): an outage then counts attempts; raise the route's "
                "timeout or lower delivery_timeout",
                route.name,
                route.timeout,
                self.delivery_timeout,
                REPORT_GRACE,
                extra={"action": "kafka_timeout_short", "handler": route.name},
            )

    def outbox_share_breakers(self, board: BreakerBoard) -> None:
        """The relay's board: how the brokers' return releases the messages parked on them, in every relay."""
        self._recovery.share(board)

    async def outbox_shutdown(self) -> None:
        """Flush and close this relay's producer (the relay calls this when it stops)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.pop(loop, None)
            replaced = [task for task in self._closing if task.get_loop() is loop]
        if session is not None:
            await self._close(session)
        await asyncio.gather(*replaced)  # producers replaced after a fatal error, still closing

    async def _close(self, session: Session) -> None:
        left = await asyncio.to_thread(session.close, self.delivery_timeout)
        if left:
            log.warning(
                "Kafka producer closed with %d message(s) unacknowledged; their attempts are retried", left
            )

    # -- delivery -----------------------------------------------------------------------

    def _session(self) -> Session:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is not None and session.fatal is None:
                return session
            if session is not None:  # fenced or otherwise dead: its messages were all failed already
                task = loop.create_task(self._close(session))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            session = self._sessions[loop] = Session(self._config, self._redactor, loop, self._recovery)
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
        """Produce one message and wait for its delivery report: the batch path with a batch of one."""
        (outcome,) = await self._produce_all([message])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        """Produce every message, then wait for all their delivery reports together.

        One outcome per message, in order: topic, partition and offset once
        Kafka acknowledged it, else the exception its attempt ends with (see
        the module's table). ``delivery_timeout`` bounds the whole batch's wait.
        """
        return await self._produce_all(messages)

    async def _produce_all(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        outcomes: list[dict[str, Any] | Exception] = []
        waiting: list[tuple[int, str, asyncio.Future[Report]]] = []
        session = self._session()
        loop = asyncio.get_running_loop()
        for index, message in enumerate(messages):
            try:
                topic = self._topic_of(message)
            except PermanentError as exc:
                outcomes.append(exc)
                continue
            if session.away and self._recovery.parks:  # nothing is produced while every broker is down
                outcomes.append(
                    self._recovery.parked("every broker is down", {"reason": "unavailable", "topic": topic})
                )
                continue
            env = envelope(message, source=self.source)
            future: asyncio.Future[Report] = loop.create_future()
            try:
                session.producer.produce(
                    topic,
                    value=env.body,
                    key=None if env.key is None else env.key.encode(),
                    headers=[(name, value.encode()) for name, value in env.headers.items()],
                    on_delivery=functools.partial(session.report, future),
                )
            except BufferError:
                outcomes.append(
                    RetryLater(
                        "the Kafka producer's local queue is full; not counted",
                        delay=UNAVAILABLE_RETRY,
                        counts_as_attempt=False,
                        detail={"reason": "queue_full", "topic": topic},
                    )
                )
                continue
            except KafkaException as exc:
                outcomes.append(self._refusal(exc.args[0], topic, session))
                continue
            outcomes.append({"topic": topic})
            waiting.append((index, topic, future))
        if not waiting:
            return outcomes
        try:
            await asyncio.wait(
                [future for *_, future in waiting], timeout=self.delivery_timeout + REPORT_GRACE
            )
        finally:  # reports that never came, or this call cancelled: nobody waits for them any more
            for *_, future in waiting:
                future.cancel()
        for index, topic, future in waiting:
            if future.cancelled() and session.away and self._recovery.parks:
                outcomes[index] = self._recovery.parked(
                    f"no delivery report within {self.delivery_timeout:g}s, every broker is down",
                    {"reason": "timeout", "topic": topic},
                )
                continue
            if future.cancelled():
                outcomes[index] = RetryLater(
                    f"no delivery report from Kafka within {self.delivery_timeout:g}s "
                    "(brokers unreachable or not taking writes); not counted",
                    delay=UNAVAILABLE_RETRY,
                    counts_as_attempt=False,
                    detail={"reason": "timeout", "topic": topic},
                )
                continue
            err, partition, offset = future.result()
            if err is None:
                outcomes[index] = {"topic": topic, "partition": partition, "offset": offset}
            else:
                outcomes[index] = self._refusal(err, topic, session)
        return outcomes

    def _refusal(self, err: object, topic: str, session: Session) -> Exception:
        """What one message's attempt ends with, given the error its produce or its report gave."""
        if not isinstance(err, KafkaError):
            return RetryLater(f"Kafka producer error: {err}", detail={"topic": topic})
        detail = {"topic": topic, "error": err.name()}
        text = f"Kafka did not take the message for {topic}: {err.name()}: {err.str()}"
        if err.fatal() or err.code() == KafkaError._FATAL or session.fatal is not None:
            session.fatal = session.fatal or err
            return RetryLater(text, detail={**detail, "reason": "fatal"})
        if err.code() in _PERMANENT:
            return PermanentError(text, detail=detail)
        if err.code() in _TOPIC_STATE:
            session.refresh(topic)
        if err.code() in UNAVAILABLE:
            if session.away and self._recovery.parks:
                return self._recovery.parked(
                    f"{text}; every broker is down", {**detail, "reason": "unavailable"}
                )
            return RetryLater(
                f"{text}; not counted",
                delay=UNAVAILABLE_RETRY,
                counts_as_attempt=False,
                detail={**detail, "reason": "unavailable"},
            )
        return RetryLater(text, detail=detail)
