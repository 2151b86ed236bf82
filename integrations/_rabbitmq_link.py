"""The connection one event loop publishes to RabbitMQ through, for ``RabbitMQPublisher``.

One connection and one confirm channel serve every concurrent delivery of a
relay. The link also keeps what publishes share: when the current outage
began, the reconnect probe that runs while the broker is away, and which
AMQP message ids are in flight (the client matches a ``basic.return`` to its
publish by message id, so two publishes with one id must never be in flight
at once).
"""

from __future__ import annotations

import asyncio

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from aiormq.exceptions import DeliveryError

from ._broker_recovery import Probe

__all__ = ["OUTAGE_RETRY_CAP", "Away", "Link", "Unreachable", "close_quietly", "connection_lost"]

#: Deferrals during an outage outside a relay: the first after a second, later ones a quarter of
#: its length so far, at most this long.
OUTAGE_RETRY_MIN = 1.0
OUTAGE_RETRY_CAP = 30.0


class Link:
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
        #: the reconnect probe, running while the broker is away
        self.probe = Probe()
        #: connections made so far: a failure on an older one says nothing about the current one
        self.generation = 0

    def outage_delay(self) -> float:
        """How long a message deferred by this outage waits: longer as the outage goes on."""
        now = asyncio.get_running_loop().time()
        if self.down_since is None:
            self.down_since = now
        return min(OUTAGE_RETRY_CAP, max(OUTAGE_RETRY_MIN, (now - self.down_since) / 4))

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
            await close_quietly(old, self.close_timeout)


async def close_quietly(connection: AbstractConnection, timeout: float) -> None:
    """Close, waiting no longer than ``timeout``: a blocked broker may never answer the close."""
    if connection.is_closed:
        return
    try:
        async with asyncio.timeout(timeout):
            await connection.close()
    except Exception:  # gone or blocked: nothing more to release
        pass


class Away(Exception):
    """The broker is known to be away: a delivery parks instead of trying to connect."""


class Unreachable(Exception):
    """No connection within the publish timeout: the broker is unreachable, not blocked."""


def connection_lost(exc: BaseException | None) -> bool:
    """The connection or channel is gone: nothing is known of the message, and the next call reconnects.

    RuntimeError is aiormq's ChannelInvalidStateError when the channel closed
    under a publish. The broker's own answers (a return, a nack) are AMQP
    errors too, and a timeout is an OSError: those say something else.
    """
    return isinstance(
        exc, aiormq.exceptions.AMQPError | ConnectionError | OSError | RuntimeError
    ) and not isinstance(exc, DeliveryError | TimeoutError)
