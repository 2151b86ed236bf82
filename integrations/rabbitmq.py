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
cannot connect; connection or channel   deferred, not counted; the next publish reconnects
lost
exchange missing (not declared)         retried, the reason recorded
======================================  ===================================================

A deferral that is not counted says nothing about the message: a broker
outage of any length uses up no attempts. Such deferrals wait longer as the
outage goes on (a second at first, then a quarter of the time the broker has
been away, at most ``_OUTAGE_RETRY_CAP`` seconds), so a long outage does not
turn into a storm of claims and history rows.

Returns are matched to publishes by AMQP ``message_id`` (the client's rule), and
one event published by several routes shares its ``message_id`` (the
``ce-id``): two publishes with the same id are never in flight at once on one
channel, so a return always reaches the publish it belongs to.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from aiormq.exceptions import DeliveryError, PublishError
from yarl import URL

from outbox import ConfigurationError, Message, PermanentError, RetryLater

from ._envelope import RoutingTemplate, envelope
from ._per_loop import PerLoop

__all__ = ["RabbitMQPublisher"]

ExchangeKind = Literal["direct", "topic", "fanout", "headers"]
_KINDS: tuple[str, ...] = ("direct", "topic", "fanout", "headers")
_CONNECT_TIMEOUT = 10.0
_CLOSE_TIMEOUT = 5.0
#: Deferrals during an outage: the first after a second, later ones a quarter of its length so far.
_OUTAGE_RETRY_MIN = 1.0
_OUTAGE_RETRY_CAP = 30.0
_UNROUTABLE = ("dead", "retry")


def _check_url(url: object) -> URL:
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"the RabbitMQ URL must be a non-empty string, got {type(url).__name__}")
    try:
        parsed = URL(url)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"invalid RabbitMQ URL: {exc}") from None
    if parsed.scheme not in ("amqp", "amqps"):
        shown = parsed.with_password("***") if parsed.password else parsed
        raise ConfigurationError(f"RabbitMQ URLs must be amqp:// or amqps://, got {str(shown)!r}")
    if not parsed.host:
        raise ConfigurationError("the RabbitMQ URL has no host")
    return parsed


def _positive(what: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


class _Link:
    """The connection, channel and exchange one event loop publishes through, opened on first use."""

    def __init__(self, close_timeout: float) -> None:
        self.close_timeout = close_timeout
        self.lock = asyncio.Lock()
        self.connection: AbstractConnection | None = None
        self.channel: AbstractChannel | None = None
        self.exchange: AbstractExchange | None = None
        #: loop time the broker was first found unreachable in the current outage (None: reachable)
        self.down_since: float | None = None
        #: publishes in flight by AMQP message_id: the client matches a return to its publish by it
        self.publishing: dict[str, asyncio.Future[None]] = {}

    def outage_delay(self) -> float:
        """How long a message deferred by this outage waits: longer as the outage goes on."""
        now = asyncio.get_running_loop().time()
        if self.down_since is None:
            self.down_since = now
        return min(_OUTAGE_RETRY_CAP, max(_OUTAGE_RETRY_MIN, (now - self.down_since) / 4))

    async def one_at_a_time(self, message_id: str) -> asyncio.Future[None]:
        """Wait until no publish with ``message_id`` is in flight, then claim the id; resolve the result."""
        while (earlier := self.publishing.get(message_id)) is not None and not earlier.done():
            await asyncio.shield(earlier)
        self.publishing[message_id] = done = asyncio.get_running_loop().create_future()

        def forget(finished: asyncio.Future[None]) -> None:
            if self.publishing.get(message_id) is finished:
                del self.publishing[message_id]

        done.add_done_callback(forget)
        return done

    def usable(self) -> bool:
        return (
            self.connection is not None
            and not self.connection.is_closed
            and self.channel is not None
            and not self.channel.is_closed
            and self.exchange is not None
        )

    async def drop(self, connection: AbstractConnection | None = None) -> None:
        """Forget the connection (only ``connection``, if given: a newer one may already be in use)."""
        if connection is not None and connection is not self.connection:
            return
        old, self.connection, self.channel, self.exchange = self.connection, None, None, None
        if old is not None:
            await _close_quietly(old, self.close_timeout)


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
        self._url = _check_url(url)
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
        self.publish_timeout = _positive("publish_timeout", publish_timeout)
        if on_unroutable not in _UNROUTABLE:
            raise ConfigurationError(f"on_unroutable must be 'dead' or 'retry', got {on_unroutable!r}")
        self.on_unroutable = on_unroutable
        self._links: PerLoop[_Link] = PerLoop(lambda: _Link(min(self.publish_timeout, _CLOSE_TIMEOUT)))

    @property
    def url(self) -> str:
        """The broker URL with its password masked: what errors, logs and ``repr`` show."""
        return str(self._url.with_password("***")) if self._url.password else str(self._url)

    def __repr__(self) -> str:
        key = self.routing_key.template
        return f"<RabbitMQPublisher {self.url} exchange={self.exchange!r} routing_key={key!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """The URL's password, decoded and as written (percent-encoded), and the URL itself."""
        found = [self._raw_url] if self._url.password else []
        for value in (self._url.password, self._url.raw_password):
            if value:
                found.append(value)
        return found

    def _scrub(self, text: str) -> str:
        for secret in sorted(self.outbox_secrets(), key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    async def outbox_shutdown(self) -> None:
        """Close the running loop's connection (the relay calls this when it stops)."""
        link = self._links.pop(asyncio.get_running_loop())
        if link is not None:
            await link.drop()

    # -- delivery -----------------------------------------------------------------------

    async def __call__(self, message: Message) -> dict[str, Any]:
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
        detail: dict[str, Any] = {"exchange": self.exchange, "routing_key": routing_key}
        link = self._link()
        connection: AbstractConnection | None = None
        turn: asyncio.Future[None] | None = None
        try:
            async with asyncio.timeout(self.publish_timeout):
                exchange, connection = await self._open(link)
                turn = await link.one_at_a_time(env.id)
                await exchange.publish(amqp, routing_key, mandatory=True)
            link.down_since = None
        except PublishError as exc:
            reply = None if exc.message is None else exc.message.delivery
            code, text = getattr(reply, "reply_code", None), getattr(reply, "reply_text", None)
            why = (
                f"unroutable: exchange {self.exchange!r} has no queue bound for routing key "
                f"{routing_key!r} ({code} {text})"
            )
            facts = {**detail, "reason": "unroutable", "reply_code": code, "reply_text": text}
            if self.on_unroutable == "retry":
                raise RetryLater(why, detail=facts) from None
            raise PermanentError(why, detail=facts) from None
        except DeliveryError as exc:
            raise RetryLater(
                f"the broker refused the message ({exc.frame.name}): a queue bound to {self.exchange!r} "
                "is full and rejects publishes, or the broker failed to store it",
                detail={**detail, "reason": "nacked"},
            ) from None
        except TimeoutError:
            raise RetryLater(
                f"no confirm from {self.url} within {self.publish_timeout:g}s "
                "(broker blocked, e.g. a memory or disk alarm, or unreachable); not counted",
                delay=link.outage_delay(),
                counts_as_attempt=False,
                detail={**detail, "reason": "timeout"},
            ) from None
        except _ExchangeMissing as exc:
            raise RetryLater(str(exc), detail={**detail, "reason": "exchange_missing"}) from None
        except (aiormq.exceptions.AMQPError, ConnectionError, OSError, RuntimeError) as exc:
            # RuntimeError: aiormq's ChannelInvalidStateError when the channel closed under us.
            await link.drop(connection)
            raise RetryLater(
                f"RabbitMQ at {self.url}: {type(exc).__name__}: {self._scrub(str(exc))}; not counted",
                delay=link.outage_delay(),
                counts_as_attempt=False,
                detail={**detail, "reason": "connection"},
            ) from None
        finally:
            if turn is not None and not turn.done():
                turn.set_result(None)
        return detail

    def _link(self) -> _Link:
        return self._links.get()

    async def _open(self, link: _Link) -> tuple[AbstractExchange, AbstractConnection]:
        """The loop's exchange handle, connecting first if there is none or the old one is closed."""
        if not link.usable():
            async with link.lock:
                if not link.usable():
                    await link.drop()
                    await self._connect(link)
        assert link.exchange is not None and link.connection is not None
        return link.exchange, link.connection

    async def _connect(self, link: _Link) -> None:
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
            await _close_quietly(connection, link.close_timeout)
            raise
        link.connection, link.channel, link.exchange = connection, channel, exchange


class _ExchangeMissing(Exception):
    pass


async def _close_quietly(connection: AbstractConnection, timeout: float) -> None:
    """Close, waiting no longer than ``timeout``: a blocked broker may never answer the close."""
    if connection.is_closed:
        return
    try:
        async with asyncio.timeout(timeout):
            await connection.close()
    except Exception:  # gone or blocked: nothing more to release
        pass
