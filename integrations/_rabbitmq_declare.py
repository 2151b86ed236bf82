"""``QueueDeclaration``: the queue a ``RabbitMQConsumer`` declares and binds, in the publisher's terms.

A consumer whose queue does not exist yet would otherwise fail, and a
publisher whose messages no queue is bound for has them returned as
unroutable: whoever starts first must make the queue and its bindings. The
consumer is the natural owner (it knows what it wants to receive), so it may
declare them on every connect, idempotently, in the words the publisher
uses: its exchange, its routing-key template (``"orders.{event_type}"``),
and the event types wanted, in the inbox's topic rules (``"order.*"``),
which are RabbitMQ's own. Everything is checked when the declaration is
made; a declaration that disagrees with what the broker already has (another
queue type, another exchange type) is the broker's one-line refusal at
start-up.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractQueue

from outbox import ConfigurationError
from outbox._topic import topic_pattern_problem

__all__ = ["QueueDeclaration", "declare"]

ExchangeKind = Literal["direct", "topic", "fanout", "headers"]
_KINDS: tuple[str, ...] = ("direct", "topic", "fanout", "headers")
_QUEUE_TYPES = ("quorum", "classic")
#: AMQP short strings (queue names, routing keys) are at most 255 bytes.
SHORT_STRING = 255


def short_string(what: str, value: object) -> str:
    """A queue name or routing key the broker accepts: text of 1 to 255 UTF-8 bytes."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string, got {value!r}")
    if len(value.encode("utf-8", "surrogatepass")) > SHORT_STRING:
        raise ConfigurationError(f"{what} must be at most {SHORT_STRING} bytes of UTF-8: {value[:40]!r}...")
    return value


def _binding_keys(routing_key: str, event_types: Sequence[str]) -> tuple[str, ...]:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(routing_key) if name is not None]
    except ValueError as exc:  # an unmatched brace
        raise ConfigurationError(f"routing_key {routing_key!r}: {exc}") from None
    if any(name != "event_type" for name in fields):
        raise ConfigurationError(
            f"routing_key {routing_key!r}: a binding can be made from {{event_type}} alone; "
            "for other fields give the binding keys as event_types with routing_key='{event_type}'"
        )
    keys = []
    for pattern in event_types:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigurationError(f"event_types must hold non-empty strings, got {pattern!r}")
        problem = topic_pattern_problem(pattern)
        if problem:
            raise ConfigurationError(f"event_types: {problem}")
        keys.append(short_string("a binding key", routing_key.replace("{event_type}", pattern)))
    return tuple(dict.fromkeys(keys))


@dataclass(frozen=True)
class QueueDeclaration:
    """Declare the consumer's queue (durable) and bind it to ``exchange`` for ``event_types``.

    ``routing_key`` is the publisher's template; each event type pattern is
    put in place of ``{event_type}`` to make a binding key, so
    ``QueueDeclaration("orders", ["order.*"], routing_key="orders.{event_type}")``
    binds ``orders.order.*``. ``declare_exchange`` declares the exchange too
    (durable, of that type) unless None, where it must exist already.
    ``exchange=None`` declares the queue alone (messages published to the
    default exchange with the queue's name as routing key). ``queue_type``:
    ``"quorum"`` (replicated, and its delivery count gives each message's
    attempt) or ``"classic"``. ``arguments`` are further ``x-`` arguments of
    the queue (``{"x-single-active-consumer": True}``).
    """

    exchange: str | None
    event_types: Sequence[str] = ("#",)
    routing_key: str = "{event_type}"
    declare_exchange: ExchangeKind | None = "topic"
    queue_type: Literal["quorum", "classic"] = "quorum"
    arguments: Mapping[str, Any] | None = None
    binding_keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        exchange = self.exchange
        if exchange is not None and (not isinstance(exchange, str) or not exchange):
            raise ConfigurationError(
                f"exchange must be a non-empty string, or None to declare the queue alone, got {exchange!r}"
            )
        if exchange is not None:
            short_string("exchange", exchange)
        if self.declare_exchange is not None and self.declare_exchange not in _KINDS:
            raise ConfigurationError(
                f"declare_exchange must be None or one of {', '.join(_KINDS)}, got {self.declare_exchange!r}"
            )
        if exchange is not None and exchange.startswith("amq.") and self.declare_exchange is not None:
            raise ConfigurationError(
                f"exchange {exchange!r}: names starting with 'amq.' are reserved by RabbitMQ; "
                "bind to it with declare_exchange=None"
            )
        if isinstance(self.event_types, str) or not isinstance(self.event_types, Sequence):
            raise ConfigurationError(
                f"event_types must be a list of event types or patterns, got {self.event_types!r}"
            )
        if not self.event_types:
            raise ConfigurationError("event_types must not be empty: '#' takes every event type")
        if not isinstance(self.routing_key, str) or not self.routing_key:
            raise ConfigurationError(f"routing_key must be a non-empty string, got {self.routing_key!r}")
        if self.queue_type not in _QUEUE_TYPES:
            raise ConfigurationError(f"queue_type must be 'quorum' or 'classic', got {self.queue_type!r}")
        if self.arguments is not None and (
            not isinstance(self.arguments, Mapping) or not all(isinstance(k, str) for k in self.arguments)
        ):
            raise ConfigurationError(f"arguments must map names to values, got {self.arguments!r}")
        if self.arguments and "x-queue-type" in self.arguments:
            raise ConfigurationError("arguments: give the queue type as queue_type=, not x-queue-type")
        keys = _binding_keys(self.routing_key, list(self.event_types)) if self.exchange is not None else ()
        if self.exchange is None and tuple(self.event_types) != ("#",):
            raise ConfigurationError("event_types need an exchange to bind to; give exchange=...")
        object.__setattr__(self, "event_types", tuple(self.event_types))
        object.__setattr__(self, "binding_keys", keys)

    @property
    def queue_arguments(self) -> dict[str, Any]:
        return {**(self.arguments or {}), "x-queue-type": self.queue_type}


async def declare(channel: AbstractChannel, queue: str, declaration: QueueDeclaration) -> AbstractQueue:
    """Declare (idempotently) the exchange, the queue and its bindings; the broker's refusal is raised."""
    declared = await channel.declare_queue(queue, durable=True, arguments=declaration.queue_arguments)
    if declaration.exchange is None:
        return declared
    if declaration.declare_exchange is not None:
        exchange = await channel.declare_exchange(
            declaration.exchange, aio_pika.ExchangeType(declaration.declare_exchange), durable=True
        )
    else:
        exchange = await channel.get_exchange(declaration.exchange, ensure=True)
    for key in declaration.binding_keys:
        await declared.bind(exchange, key)
    return declared
