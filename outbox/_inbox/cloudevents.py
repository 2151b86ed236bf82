"""An incoming broker message read as the CloudEvents binary-mode envelope our publishers send.

Every publisher of this package (RabbitMQ, NATS, Kafka) sends the event's
JSON payload as the body and its identity as ``ce-*`` headers: ``ce-id`` (the
event id, kept by retries and requeues), ``ce-type``, ``ce-time`` (when it
was emitted). The sources read them back here, one mapping for all brokers,
so a message from any of them reaches the inbox the same way.

A message that cannot be read whole still becomes an :class:`InboxMessage`,
with the reason beside it: the source records it as a dead letter before
acknowledging it, so a foreign or broken message is kept for an operator, not
dropped and not redelivered forever.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

from .._exceptions import InvalidInboxMessage
from .checks import check_message
from .message import InboxMessage

__all__ = ["UNKNOWN_TYPE", "Decoded", "from_cloudevent", "header_text"]

#: The event type stored for a message that carried none (a dead letter's ``event_type``).
UNKNOWN_TYPE: Final = "(unknown)"

Decoded = tuple[InboxMessage, InvalidInboxMessage | None]


def header_text(value: Any) -> str:
    """A header's value as text: brokers hand bytes (Kafka, NATS) or str (RabbitMQ) or numbers."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return value if isinstance(value, str) else str(value)


def _lowered(headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    items = headers.items() if isinstance(headers, Mapping) else (headers or ())
    return {str(name).lower(): header_text(value) for name, value in items if value is not None}


def _sent_at(text: str) -> datetime:
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidInboxMessage(f"ce-time {text[:40]!r} is not an RFC 3339 time") from None
    if moment.tzinfo is None:
        raise InvalidInboxMessage(f"ce-time {text[:40]!r} has no UTC offset")
    return moment.astimezone(UTC)


def _payload(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (UnicodeDecodeError, ValueError) as error:
        raise InvalidInboxMessage(f"the body is not JSON: {error}") from None


def _digest_id(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def from_cloudevent(
    headers: Mapping[str, Any] | Iterable[tuple[str, Any]] | None,
    body: bytes,
    *,
    source: str,
    attempt: int = 1,
    fallback_id: str | None = None,
) -> Decoded:
    """The inbox message a delivery carries, and why it cannot be processed (None when it can).

    ``fallback_id`` is the broker's own message id, used when there is no
    ``ce-id`` (a producer that is not ours). With neither, the message is
    named by its body's digest and refused: without a producer's id a
    redelivery cannot be told from a new message.
    """
    found = _lowered(headers)
    problems: list[str] = []
    message_id = found.get("ce-id") or fallback_id
    if not message_id:
        problems.append("it has no ce-id header and no message id: a duplicate cannot be told apart")
        message_id = _digest_id(body)
    event_type = found.get("ce-type") or ""
    if not event_type:
        problems.append("it has no ce-type header")
        event_type = UNKNOWN_TYPE
    sent_at = None
    if found.get("ce-time"):
        try:
            sent_at = _sent_at(found["ce-time"])
        except InvalidInboxMessage as error:
            problems.append(str(error))
    try:
        payload = _payload(body)
    except InvalidInboxMessage as error:
        problems.append(str(error))
        payload = body.decode("utf-8", "replace")
    message = InboxMessage(
        message_id, event_type, payload, found, source=source, sent_at=sent_at, attempt=max(attempt, 1)
    )
    try:
        message = check_message(message)
    except InvalidInboxMessage as error:  # an id or type the inbox cannot store: keep it under its digest
        problems.append(str(error))
        message = InboxMessage(
            _digest_id(message_id.encode("utf-8", "replace")),
            event_type if len(event_type) <= 255 else UNKNOWN_TYPE,
            payload,
            found,
            source=source,
            sent_at=sent_at,
            attempt=max(attempt, 1),
        )
    if not problems:
        return message, None
    return message, InvalidInboxMessage("cannot process this message: " + "; ".join(problems))
