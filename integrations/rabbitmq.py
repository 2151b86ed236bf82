"""Publish outbox events to a RabbitMQ exchange with aio-pika, confirmed by the broker.

::

    from outbox.integrations.rabbitmq import RabbitMQPublisher

    ob.route(
        "order.paid",
        RabbitMQPublisher("amqp://app:secret@rabbit/", exchange="orders", routing_key="orders.{event_type}"),
        name="orders_rabbit",
    )

A message counts as delivered only once the broker has confirmed it
(publisher confirms) and routed it to at least one queue (``mandatory``):
an ack without a queue would be a silent loss.

======================================  ===================================================
confirmed (``basic.ack``)               delivered; the detail records exchange, routing key
returned unroutable (``basic.return``)  dead at once, ``unroutable: ...``; with
                                        ``on_unroutable="retry"`` retried, counted
refused (``basic.nack``)                retried (a full queue with ``x-overflow: reject-publish``)
no confirm within ``publish_timeout``   deferred, not counted (the broker is blocked by an
                                        alarm or unreachable; it may still accept it later:
                                        a duplicate)
cannot connect; connection or channel   parked until the broker is back, not counted
lost
exchange missing (not declared)         retried, the reason recorded
======================================  ===================================================

A deferral that is not counted says nothing about the message: a broker
outage of any length uses up no attempts. A parked message
(``_broker_recovery``, keyed ``amqp://host:port/vhost``) waits for one
reconnect probe per relay, once a second, whose success sends every message
parked on the broker at once; messages claimed meanwhile park without a
connection attempt each. Outside a relay nothing parks: such deferrals wait a
second, then a quarter of the outage so far, at most ``OUTAGE_RETRY_CAP``
seconds (``_rabbitmq_link.py``). A broker that takes the connection but
withholds confirms (a memory or disk alarm) is not parked: nothing would tell
its end.

The relay hands the publisher a claim's messages at once
(``outbox_deliver_batch``): all of them go out on the channel together and
their confirms are awaited together, under one ``publish_timeout``. Each
message's confirm, return or nack decides its own outcome alone, as in the
table; a lost connection parks the messages it left unconfirmed.

Returns are matched to publishes by AMQP ``message_id`` (the client's rule), and
one event published by several routes shares its ``message_id`` (the
``ce-id``): two publishes with the same id are never in flight at once on one
channel (a second one waits for the first, even within a batch), so a return
always reaches the publish it belongs to.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection, AbstractExchange
from aiormq.exceptions import DeliveryError, PublishError

from outbox import ConfigurationError, Message, PermanentError, RetryLater

from ._broker_recovery import Recovery
from ._envelope import RoutingTemplate, envelope
from ._per_loop import PerLoop
from ._rabbitmq_config import check_url, positive, secrets, shown
from ._rabbitmq_consumer import QueueDeclaration, RabbitMQConsumer
from ._rabbitmq_link import Away, Link, Unreachable, close_quietly, connection_lost

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

__all__ = ["QueueDeclaration", "RabbitMQConsumer", "RabbitMQPublisher"]

ExchangeKind = Literal["direct", "topic", "fanout", "headers"]
_KINDS: tuple[str, ...] = ("direct", "topic", "fanout", "headers")
_CONNECT_TIMEOUT = 10.0
_CLOSE_TIMEOUT = 5.0
_UNROUTABLE = ("dead", "retry")


class RabbitMQPublisher:
    """Publish each message to ``exchange`` with the CloudEvents envelope, persistent and confirmed.

    ``routing_key`` is a template over ``{event_type}``, ``{aggregate_type}``,
    ``{aggregate_id}`` and ``{handler}``. ``source`` becomes ``ce-source``.
    ``publish_timeout`` bounds connecting plus waiting for the confirm; keep it
    below the route's timeout so the reason recorded is ours. The exchange must
    exist unless ``declare_exchange`` names a type to declare it (durable) with
    on first use. ``correlation_id``, a template like ``routing_key``, sets the
    AMQP correlation id. ``on_unroutable`` says what a message no queue is bound
    for becomes: ``"dead"`` at once (the default: a binding is missing, and
    nothing will change until someone adds it), or ``"retry"``, a counted
    attempt with the route's backoff (the queues are declared by consumers that
    may not have started yet). One connection and one channel serve every
    concurrent delivery of a relay.
    """

    def __init__(
        self,
        url: str,
        exchange: str,
        routing_key: str = "{event_type}",
        *,
        source: str = "urn:sqlalchemy-outbox:{handler}",
        publish_timeout: float = 10.0,
        declare_exchange: ExchangeKind | None = None,
        correlation_id: str | None = None,
        on_unroutable: Literal["dead", "retry"] = "dead",
    ) -> None:
        self._url = check_url(url)
        self._raw_url = url
        if not isinstance(exchange, str):
            raise ConfigurationError(f"exchange must be a string, got {type(exchange).__name__}")
        if declare_exchange is not None and declare_exchange not in _KINDS:
            raise ConfigurationError(
                f"declare_exchange must be None or one of {', '.join(_KINDS)}, got {declare_exchange!r}"
            )
        if not exchange and declare_exchange is not None:
            raise ConfigurationError(
                "the default exchange ('') cannot be declared; leave declare_exchange=None"
            )
        if exchange.startswith("amq.") and declare_exchange is not None:
            raise ConfigurationError(
                f"exchange {exchange!r}: names starting with 'amq.' are reserved by RabbitMQ"
            )
        self.exchange = exchange
        self.declare_exchange = declare_exchange
        if not isinstance(routing_key, str):
            raise ConfigurationError(f"routing_key must be a string, got {type(routing_key).__name__}")
        self.routing_key = RoutingTemplate(routing_key, "routing_key")
        self.correlation_id = (
            None if correlation_id is None else RoutingTemplate(correlation_id, "correlation_id")
        )
        if not isinstance(source, str) or not source:
            raise ConfigurationError(f"source must be a non-empty string, got {source!r}")
        self.source = source
        self.publish_timeout = positive("publish_timeout", publish_timeout)
        if on_unroutable not in _UNROUTABLE:
            raise ConfigurationError(f"on_unroutable must be 'dead' or 'retry', got {on_unroutable!r}")
        self.on_unroutable = on_unroutable
        self._links: PerLoop[Link] = PerLoop(lambda: Link(min(self.publish_timeout, _CLOSE_TIMEOUT)))
        port = self._url.port or (5671 if self._url.scheme == "amqps" else 5672)
        self._recovery = Recovery(
            f"{self._url.scheme}://{self._url.host}:{port}{self._url.raw_path or '/'}",
            f"RabbitMQ at {self.url}",
        )

    @property
    def destination(self) -> str:
        """What a message is parked on while the broker is away: the URL without credentials."""
        return self._recovery.destination

    @property
    def url(self) -> str:
        """The broker URL with its password masked: what errors, logs and ``repr`` show."""
        return shown(self._url)

    def __repr__(self) -> str:
        key = self.routing_key.template
        return f"<RabbitMQPublisher {self.url} exchange={self.exchange!r} routing_key={key!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """The URL's password, decoded and as written (percent-encoded), and the URL itself."""
        return secrets(self._raw_url, self._url)

    def _scrub(self, text: str) -> str:
        for secret in sorted(self.outbox_secrets(), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    def outbox_share_breakers(self, board: BreakerBoard) -> None:
        """The relay's board: how a reconnect releases the messages parked on the broker, in every relay."""
        self._recovery.share(board)

    async def outbox_shutdown(self) -> None:
        """Stop the loop's reconnect probe and close its connection (the relay calls this when it stops)."""
        link = self._links.pop(asyncio.get_running_loop())
        if link is not None:
            await link.probe.stop()
            await link.drop()

    # -- delivery -----------------------------------------------------------------------

    async def __call__(self, message: Message) -> dict[str, Any]:
        """Publish one message and wait for its confirm: the batch path with a batch of one."""
        (outcome,) = await self._publish_all([message])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        """Publish every message on the channel at once, then wait for their confirms together.

        One outcome per message, in order: its detail once the broker confirmed
        it, else the exception its attempt ends with (see the module's table).
        ``publish_timeout`` bounds connecting plus the wait for the whole batch.
        """
        return await self._publish_all(messages)

    async def _publish_all(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        outcomes: list[dict[str, Any] | Exception] = []
        ready: list[tuple[int, _Publish]] = []
        for index, message in enumerate(messages):
            try:
                publish = self._prepare(message)
            except PermanentError as exc:  # a routing template this message cannot fill
                outcomes.append(exc)
                continue
            outcomes.append(publish.detail)
            ready.append((index, publish))
        if not ready:
            return outcomes
        link = self._link()
        if link.probe.away and self._recovery.parks:  # the probe is on it: no connection attempt
            for index, publish in ready:
                outcomes[index] = self._refusal(Away(), link, publish, link.generation)
            return outcomes
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.publish_timeout
        connection: AbstractConnection | None = None
        generation = link.generation
        try:
            async with asyncio.timeout_at(deadline):
                exchange, connection = await self._open(link)
        except Exception as exc:
            if connection_lost(exc):
                await link.drop(connection)
            if isinstance(exc, TimeoutError):  # no connection within the time: unreachable, not blocked
                exc = Unreachable(f"no connection within {self.publish_timeout:g}s")
            for index, publish in ready:
                outcomes[index] = self._refusal(exc, link, publish, generation)
            return outcomes
        generation = link.generation
        tasks = [asyncio.ensure_future(self._confirmed(link, exchange, publish)) for _, publish in ready]
        try:
            _, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        finally:  # the route's timeout or a stop cancels this call: no publish is left behind
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        failures = [TimeoutError() if t in late or t.cancelled() else t.exception() for t in tasks]
        if any(connection_lost(failure) for failure in failures):
            await link.drop(connection)  # once: the next call reconnects
        elif None in failures:
            link.down_since = None
        for (index, publish), failure in zip(ready, failures, strict=True):
            if failure is not None:
                outcomes[index] = self._refusal(failure, link, publish, generation)
        return outcomes

    def _prepare(self, message: Message) -> _Publish:
        routing_key = self.routing_key.render(message)
        env = envelope(message, source=self.source)
        amqp = aio_pika.Message(
            env.body,
            headers={name: value for name, value in env.headers.items() if name != "content-type"},
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=env.id,
            timestamp=message.created_at,
            correlation_id=None if self.correlation_id is None else self.correlation_id.render(message),
            type=message.event_type,
        )
        return _Publish(amqp, routing_key, env.id, {"exchange": self.exchange, "routing_key": routing_key})

    @staticmethod
    async def _confirmed(link: Link, exchange: AbstractExchange, publish: _Publish) -> None:
        """Publish once no other publish with the same AMQP message_id is in flight; wait for the confirm."""
        turn = await link.one_at_a_time(publish.message_id)
        try:
            await exchange.publish(publish.amqp, publish.routing_key, mandatory=True)
        finally:
            if not turn.done():
                turn.set_result(None)

    def _refusal(self, exc: BaseException, link: Link, publish: _Publish, generation: int) -> Exception:
        """What one message's attempt ends with, given what its connect or publish raised.

        ``generation``: the link's connection the attempt used (or tried to make).
        """
        detail, routing_key = publish.detail, publish.routing_key
        if isinstance(exc, PublishError):
            reply = None if exc.message is None else exc.message.delivery
            code, text = getattr(reply, "reply_code", None), getattr(reply, "reply_text", None)
            why = (
                f"unroutable: exchange {self.exchange!r} has no queue bound for routing key "
                f"{routing_key!r} ({code} {text})"
            )
            facts = {**detail, "reason": "unroutable", "reply_code": code, "reply_text": text}
            if self.on_unroutable == "retry":
                return RetryLater(why, detail=facts)
            return PermanentError(why, detail=facts)
        if isinstance(exc, DeliveryError):
            return RetryLater(
                f"the broker refused the message ({exc.frame.name}): a queue bound to {self.exchange!r} "
                "is full and rejects publishes, or the broker failed to store it",
                detail={**detail, "reason": "nacked"},
            )
        if isinstance(exc, TimeoutError):
            return RetryLater(
                f"no confirm from {self.url} within {self.publish_timeout:g}s "
                "(broker blocked, e.g. a memory or disk alarm, or unreachable); not counted",
                delay=link.outage_delay(),
                counts_as_attempt=False,
                detail={**detail, "reason": "timeout"},
            )
        if isinstance(exc, _ExchangeMissing):
            return RetryLater(str(exc), detail={**detail, "reason": "exchange_missing"})
        if isinstance(exc, Away):
            return self._recovery.parked("away, reconnecting", {**detail, "reason": "connection"})
        if isinstance(exc, Unreachable):
            return self._unavailable(link, generation, detail, str(exc))
        if connection_lost(exc):  # the caller dropped the connection
            why = f"{type(exc).__name__}: {self._scrub(str(exc))}"
            return self._unavailable(link, generation, detail, why)
        if isinstance(exc, Exception):
            return exc  # not the broker's answer: the relay records it as the handler's failure
        raise exc  # SystemExit and the like: what this call must not swallow

    def _link(self) -> Link:
        return self._links.get()

    # -- outages ------------------------------------------------------------------------

    def _unavailable(self, link: Link, generation: int, detail: dict[str, Any], why: str) -> RetryLater:
        """The deferral of a publish that found the broker unreachable or lost the connection."""
        facts = {**detail, "reason": "connection"}
        if not self._recovery.parks:
            return RetryLater(
                f"RabbitMQ at {self.url}: {why}; not counted",
                delay=link.outage_delay(),
                counts_as_attempt=False,
                detail=facts,
            )
        if link.generation != generation and link.usable():
            # The probe reconnected while this publish was failing: parked now, nothing would release it.
            return RetryLater(
                f"RabbitMQ at {self.url}: {why}; reconnected since, not counted",
                delay=0.0,
                counts_as_attempt=False,
                detail=facts,
            )
        link.probe.start(self._recovery, why, lambda: self._reconnect(link))
        return self._recovery.parked(why, facts)

    async def _reconnect(self, link: Link) -> None:
        """The probe's one try: connect (no exchange yet is still a broker that answers)."""
        async with asyncio.timeout(min(self.publish_timeout, _CONNECT_TIMEOUT)):
            async with link.lock:
                if not link.usable():
                    await link.drop()
                    try:
                        await self._connect(link)
                    except _ExchangeMissing:
                        pass  # the publishes that follow say what is missing
        link.down_since = None

    async def _open(self, link: Link) -> tuple[AbstractExchange, AbstractConnection]:
        """The loop's exchange handle, connecting first if there is none or the old one is closed."""
        if not link.usable():
            async with link.lock:
                if not link.usable():
                    if link.probe.away and self._recovery.parks:
                        raise Away  # the probe is on it: no connection attempt per message
                    await link.drop()
                    await self._connect(link)
        assert link.exchange is not None and link.connection is not None
        return link.exchange, link.connection

    async def _connect(self, link: Link) -> None:
        connection = await aio_pika.connect(
            self._raw_url,
            timeout=min(self.publish_timeout, _CONNECT_TIMEOUT),
            client_properties={
                "connection_name": f"sqlalchemy-outbox publisher to {self.exchange or '(default)'}"
            },
        )
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            if self.declare_exchange is not None:
                exchange = await channel.declare_exchange(
                    self.exchange, aio_pika.ExchangeType(self.declare_exchange), durable=True
                )
            elif self.exchange:
                try:
                    exchange = await channel.get_exchange(self.exchange, ensure=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    raise _ExchangeMissing(
                        f"exchange {self.exchange!r} does not exist on {self.url}; declare it, "
                        "or pass declare_exchange='topic' (or another type)"
                    ) from None
            else:
                exchange = channel.default_exchange
        except BaseException:
            await close_quietly(connection, link.close_timeout)
            raise
        link.connection, link.channel, link.exchange = connection, channel, exchange
        link.generation += 1


class _ExchangeMissing(Exception):
    pass


class _Publish(NamedTuple):
    """One message made ready to publish: what goes on the wire, and the detail its attempt records."""

    amqp: aio_pika.Message
    routing_key: str
    message_id: str  # the AMQP message_id (the ce-id), by which the client matches a return
    detail: dict[str, Any]
