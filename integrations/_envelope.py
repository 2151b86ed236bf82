"""The envelope every broker publisher sends: CloudEvents 1.0 in binary mode, one mapping for all brokers.

Binary mode keeps the body the event's own JSON payload, so a consumer that
knows nothing of CloudEvents still reads it, and puts the event's identity in
headers (``ce-*``). ``ce-id`` is the event id, which a requeued copy keeps, so
a consumer (or a broker's dedupe window) sees a requeue as the same event.
Routing names (a RabbitMQ routing key, a NATS subject, a Kafka topic) come
from a template checked when the publisher is built, not at the first publish.
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from outbox import ConfigurationError, Message, PermanentError

__all__ = ["TEMPLATE_FIELDS", "Envelope", "RoutingTemplate", "envelope"]

#: What a routing template may name: ``"{event_type}"``, ``"orders.{aggregate_type}"``...
TEMPLATE_FIELDS = ("event_type", "aggregate_type", "aggregate_id", "handler")
TRACE_HEADERS = ("traceparent", "tracestate")


class RoutingTemplate:
    """A routing name made from the message; unknown fields are refused when the publisher is built."""

    def __init__(self, template: str, what: str) -> None:
        if not template:
            raise ConfigurationError(f"{what} must not be empty")
        fields = []
        try:
            for _, name, spec, conversion in string.Formatter().parse(template):
                if name is None:
                    continue
                if name not in TEMPLATE_FIELDS or spec or conversion:
                    raise ConfigurationError(
                        f"{what} {template!r}: {{{name}}} is not one of "
                        + ", ".join(f"{{{f}}}" for f in TEMPLATE_FIELDS)
                    )
                fields.append(name)
        except ValueError as exc:  # an unmatched brace
            raise ConfigurationError(f"{what} {template!r}: {exc}") from None
        self.template = template
        self.fields = tuple(fields)
        self._what = what

    def render(self, message: Message) -> str:
        values: dict[str, str] = {}
        for name in self.fields:
            value = getattr(message, name)
            if not value:
                # Not retryable: the message will never gain the field.
                raise PermanentError(f"{self._what} {self.template!r} needs {name}, which this message lacks")
            values[name] = str(value)
        return self.template.format(**values)


@dataclass(frozen=True, slots=True)
class Envelope:
    body: bytes
    headers: dict[str, str]  # ce-* attributes, content-type, trace context
    key: str | None  # the aggregate id: per-key order where the broker partitions by key
    dedupe_id: str  # the broker's duplicate-detection id: one per event and route

    @property
    def id(self) -> str:
        return self.headers["ce-id"]


def _source(template: str, message: Message) -> str:
    return template.replace("{handler}", message.handler)


def envelope(message: Message, *, source: str = "urn:sqlalchemy-outbox:{handler}") -> Envelope:
    """The CloudEvents binary-mode envelope of ``message``.

    ``ce-source`` defaults to the route (``{handler}`` is replaced), so that
    (source, id) is unique even when two routes publish the same event.
    """
    headers: dict[str, str] = {
        "ce-specversion": "1.0",
        "ce-id": str(message.event_id),
        "ce-type": message.event_type,
        "ce-source": _source(source, message),
        "content-type": "application/json",
    }
    if message.created_at is not None:
        headers["ce-time"] = message.created_at.isoformat().replace("+00:00", "Z")
    if message.aggregate_type or message.aggregate_id:
        headers["ce-subject"] = "/".join(p for p in (message.aggregate_type, message.aggregate_id) if p)
    stored: Mapping[str, Any] = message.headers or {}
    for name in TRACE_HEADERS:
        value = stored.get(name)
        if isinstance(value, str) and value:
            headers[name] = value
    body = json.dumps(message.payload, separators=(",", ":"), ensure_ascii=False).encode()
    return Envelope(
        body=body,
        headers=headers,
        key=message.aggregate_id,
        dedupe_id=f"{message.event_id}:{message.handler}",
    )
