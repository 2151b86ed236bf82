"""``RabbitMQConsumer``: an inbox source that takes each message of a RabbitMQ queue once, with aio-pika.

::

    from outbox.integrations.rabbitmq import QueueDeclaration, RabbitMQConsumer

    inbox.consume(
        RabbitMQConsumer(
            "amqp://shipping:secret@rabbit/prod",
            "shipping.orders",
            declare=QueueDeclaration("orders", ["order.*"], routing_key="orders.{event_type}"),
        )
    )

Each delivery is read back from our publishers' CloudEvents envelope and
handed to the runtime (``outbox-consumer``), which commits its outcome and
only then acknowledges it. A delivery comes again whenever it was not
acknowledged (a crash, a lost connection, a failed handler), and the inbox
answers a second delivery of one ``ce-id`` as a duplicate: effects once.

======================================  ===================================================
handled, duplicate, unhandled, dead     acknowledged after the commit
a handler failed, or the database did   held for ``retry_delay`` of its attempt, then
                                        ``nack(requeue=True)``; the other deliveries go on
not a readable message (no ``ce-id``    recorded as a dead letter, then acknowledged
nor AMQP ``message_id``, not JSON...)
connection lost                         the broker requeues what was not acknowledged; the
                                        source reconnects every second, readiness false
queue missing at start-up               ``ConfigurationError`` naming it (unless ``declare``)
======================================  ===================================================

A quorum queue counts deliveries (``x-delivery-count``), so a message's
attempt survives restarts and moves between consumers; a classic queue does
not, and its attempts are counted by the process that handles it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from outbox import ConfigurationError, InvalidInboxMessage, SourceContext
from outbox._first_line import first_line
from outbox._inbox.checks import check_text
from outbox._inbox.cloudevents import from_cloudevent

from ._rabbitmq_config import check_url, positive, secrets, shown
from ._rabbitmq_declare import QueueDeclaration, declare, short_string
from ._rabbitmq_link import close_quietly

__all__ = ["QueueDeclaration", "RabbitMQConsumer"]

log = logging.getLogger("outbox.integrations.rabbitmq")

#: While the broker is away, one connection attempt this often.
RECONNECT_INTERVAL = 1.0
_CLOSE_TIMEOUT = 5.0
#: Message ids whose failures a source remembers at most, for the delay before their redelivery.
_FAILURES_KEPT = 10_000
#: What the broker says when the configuration is wrong (403 access refused, 404 not found,
#: 406 precondition failed): no reconnect will change it.
_REFUSALS = (
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelPreconditionFailed,
)


def delivery_attempt(headers: Mapping[str, Any] | None) -> int:
    """A quorum queue's ``x-delivery-count`` (earlier deliveries) plus this one; 1 without it."""
    count = (headers or {}).get("x-delivery-count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count + 1
    return 1


class RabbitMQConsumer:
    """Feed an inbox from ``queue``: each message taken once, acknowledged after its commit.

    ``prefetch`` (default: the runtime's concurrency) is how many
    unacknowledged messages the broker hands this source at once; a message
    waiting for its redelivery holds one of them. ``declare`` makes the queue
    and its bindings on every connect (:class:`QueueDeclaration`); without
    it the queue must exist. ``name`` (default ``rabbitmq:<queue>``) is what
    logs, metrics and each message's ``source`` say. ``connect_timeout``
    bounds connecting and opening the queue; aio-pika's options in the URL's
    query pass through (``?heartbeat=10`` finds a silently dead connection
    within two heartbeats).
    """

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        name: str | None = None,
        prefetch: int | None = None,
        declare: QueueDeclaration | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self._url = check_url(url)
        self._raw_url = url
        self.queue = short_string("queue", queue)
        if declare is not None and not isinstance(declare, QueueDeclaration):
            raise ConfigurationError(
                f"declare must be a QueueDeclaration or None, got {type(declare).__name__}"
            )
        if declare is not None and queue.startswith("amq."):
            raise ConfigurationError(f"queue {queue!r}: names starting with 'amq.' are reserved by RabbitMQ")
        self.declare = declare
        if prefetch is not None and (
            isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 1 <= prefetch <= 65535
        ):
            raise ConfigurationError(f"prefetch must be None or an int from 1 to 65535, got {prefetch!r}")
        self.prefetch = prefetch
        self.connect_timeout = positive("connect_timeout", connect_timeout)
        chosen = f"rabbitmq:{queue}" if name is None else name
        try:
            check_text("the source's name", chosen, required=True)
        except InvalidInboxMessage as exc:
            hint = "" if name is not None else " (it is rabbitmq:<queue>: give a shorter name=...)"
            raise ConfigurationError(f"{exc}{hint}") from None
        self._name = chosen
        #: the queue was there once: a later absence is an outage to wait out, not a configuration error
        self._found = False
        #: connections that got as far as consuming: a failure after one starts a new outage
        self._sessions = 0
        #: failed attempts by message id, for how long a redelivery waits (the runtime counts its own)
        self._failures: OrderedDict[str, int] = OrderedDict()

    @property
    def name(self) -> str:
        return self._name

    @property
    def url(self) -> str:
        """The broker URL with its password masked: what errors, logs and ``repr`` show."""
        return shown(self._url)

    def __repr__(self) -> str:
        return f"<RabbitMQConsumer {self.url} queue={self.queue!r} name={self._name!r}>"

    def outbox_secrets(self) -> list[str]:
        """The URL's password, decoded and as written (percent-encoded), and the URL itself."""
        return secrets(self._raw_url, self._url)

    def _scrub(self, text: str) -> str:
        for secret in sorted(self.outbox_secrets(), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    # -- the source ---------------------------------------------------------------------------

    async def consume(self, context: SourceContext) -> None:
        """Connect, consume until stopped, reconnect through outages; see the module's table."""
        prefetch = self.prefetch or context.concurrency
        away: str | None = None  # why the broker is away, once said
        while not context.stopping.is_set():
            try:
                connection = await self._connect()
            except Exception as exc:  # refused, reset, timed out, credentials refused
                away = self._away(context, away, exc)
                await _pause(context.stopping, RECONNECT_INTERVAL)
                continue
            sessions = self._sessions
            try:
                why = await self._serve(connection, context, prefetch)
            except _REFUSALS as exc:
                said = self._scrub(first_line(exc))
                refusal = f"RabbitMQ at {self.url} refused queue {self.queue!r}: {said}"
                if not self._found:
                    raise ConfigurationError(self._advice(refusal, exc)) from None
                why = refusal  # it was there before: someone is changing the broker, wait
            except Exception as exc:  # the connection or channel broke while opening
                why = f"{type(exc).__name__}: {self._scrub(first_line(exc))}"
            finally:
                await close_quietly(connection, _CLOSE_TIMEOUT)
            if why is None:
                return
            # A new outage if it consumed meanwhile (said again), else the same one going on.
            away = self._away(context, None if self._sessions != sessions else away, why)
            await _pause(context.stopping, RECONNECT_INTERVAL)

    def _advice(self, refusal: str, exc: BaseException) -> str:
        if isinstance(exc, aiormq.exceptions.ChannelNotFoundEntity) and self.declare is None:
            return f"{refusal}; declare it, or pass declare=QueueDeclaration(...)"
        return refusal

    def _away(self, context: SourceContext, away: str | None, exc: BaseException | str) -> str:
        """Readiness false; the reason said once per outage (and again when it changes)."""
        why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {self._scrub(first_line(exc))}"
        context.connected(False)
        if why != away:
            log.warning(
                "source %s: RabbitMQ at %s: %s; trying again every %gs",
                self._name,
                self.url,
                why,
                RECONNECT_INTERVAL,
                extra={"action": "broker_away", "source": self._name},
            )
        else:
            log.debug("source %s: still away: %s", self._name, why, extra={"action": "broker_still_away"})
        return why

    async def _connect(self) -> AbstractConnection:
        return await aio_pika.connect(
            self._raw_url,
            timeout=self.connect_timeout,
            client_properties={"connection_name": f"sqlalchemy-outbox consumer of {self.queue}"},
        )

    async def _open(self, channel: AbstractChannel) -> AbstractQueue:
        async with asyncio.timeout(self.connect_timeout):
            if self.declare is not None:
                queue = await declare(channel, self.queue, self.declare)
            else:
                queue = await channel.get_queue(self.queue, ensure=True)
        self._found = True
        return queue

    async def _serve(
        self, connection: AbstractConnection, context: SourceContext, prefetch: int
    ) -> str | None:
        """Consume on one connection: None once stopped, else why the connection ended."""
        lost = asyncio.Event()
        reasons: list[str] = []

        def gone(_sender: object, exc: BaseException | None = None, *_: object) -> None:
            if exc is not None and not isinstance(exc, asyncio.CancelledError):
                reasons.append(f"{type(exc).__name__}: {self._scrub(first_line(exc))}")
            lost.set()

        connection.close_callbacks.add(gone)
        channel = await connection.channel(publisher_confirms=False)
        channel.close_callbacks.add(gone)
        await channel.set_qos(prefetch_count=prefetch)
        queue = await self._open(channel)

        def cancelled(_frame: object) -> None:
            reasons.append(f"the broker cancelled the consumer of {self.queue!r} (queue deleted?)")
            lost.set()

        (await channel.get_underlay_channel()).on_consumer_cancel_callbacks.add(cancelled)
        release = asyncio.Event()  # ends the waits of messages held for a redelivery
        tasks: set[asyncio.Task[None]] = set()

        async def on_message(incoming: AbstractIncomingMessage) -> None:
            if context.stopping.is_set() or lost.is_set():
                return  # not taken: the broker gives it back when the channel closes
            task = asyncio.create_task(self._deliver(incoming, context, release))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        tag = await queue.consume(on_message)
        self._sessions += 1
        context.connected(True)
        stopping = asyncio.ensure_future(context.stopping.wait())
        broken = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait([stopping, broken], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            broken.cancel()
        if lost.is_set():  # not ready from now: what is in hand finishes, its acknowledgements fail
            context.connected(False)
        else:  # stopping: fetch nothing more, hand back what waits, finish the rest
            try:
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await queue.cancel(tag)
            except Exception:  # gone meanwhile: closing the connection gives everything back
                pass
        release.set()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if context.stopping.is_set():
            return None
        return reasons[0] if reasons else "the connection closed"

    async def _deliver(
        self, incoming: AbstractIncomingMessage, context: SourceContext, release: asyncio.Event
    ) -> None:
        """One delivery through the inbox; a failed one is held, then handed back for a redelivery."""
        message, problem = from_cloudevent(
            incoming.headers,
            incoming.body,
            source=self._name,
            attempt=delivery_attempt(incoming.headers),
            fallback_id=incoming.message_id,
        )
        try:
            if problem is not None:
                if await context.refuse(message, problem, ack=incoming.ack):
                    return
            elif await context.take(message, ack=incoming.ack) is not None:
                self._failures.pop(message.id, None)
                return
        except Exception:  # a bug, not the message's fault: log it, and let the message come again
            log.exception(
                "source %s: message %s could not be handed to the inbox",
                self._name,
                message.id,
                extra={"action": "source_error", "source": self._name, "message_id": message.id},
            )
        attempt = self._failed(message.id, message.attempt)
        try:
            await asyncio.wait_for(release.wait(), timeout=context.retry_delay(attempt))
        except TimeoutError:
            pass
        try:
            await incoming.nack(requeue=True)
        except Exception:  # the channel is gone: the broker has given it back already
            pass

    def _failed(self, message_id: str, attempt: int) -> int:
        """The attempt that failed, counted as the runtime counts it: a classic queue does not count."""
        seen = self._failures.get(message_id, 0)
        failed = seen + 1 if seen >= attempt else attempt
        self._failures[message_id] = failed
        self._failures.move_to_end(message_id)
        while len(self._failures) > _FAILURES_KEPT:
            self._failures.popitem(last=False)
        return failed


async def _pause(stopping: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
    except TimeoutError:
        pass
