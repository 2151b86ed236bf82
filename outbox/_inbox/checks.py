"""An incoming message checked at the edge, before anything is written.

A source decodes whatever arrives; what it hands the inbox is checked here,
so a bad id is refused with a message that names it, not by the database
halfway through the caller's transaction.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import UTC, datetime
from typing import Any

from .._exceptions import InvalidInboxMessage
from .._write.payload import text_problem
from .message import InboxMessage

__all__ = ["MESSAGE_ID_LIMIT", "check_message", "check_message_id", "check_sent_at", "check_text"]

#: Width of ``outbox_inbox.message_id`` (and of event_type and source).
MESSAGE_ID_LIMIT = 255


def check_message_id(value: Any) -> str:
    """The id as stored: a non-empty string of at most 255 characters; a UUID or an int as its text."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        raise InvalidInboxMessage(
            "a message id must be text, got bytes: decode it first (e.g. value.decode('utf-8'))"
        )
    if not isinstance(value, str):
        raise InvalidInboxMessage(f"a message id must be a string, UUID or int, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInboxMessage(
            f"a message id must not be empty or blank, got {value!r}: "
            "without an id a duplicate cannot be told apart"
        )
    if len(value) > MESSAGE_ID_LIMIT:
        raise InvalidInboxMessage(
            f"a message id must be at most {MESSAGE_ID_LIMIT} characters, got {len(value)} "
            f"({value[:40]!r}...); hash a longer one (e.g. hashlib.sha256(value.encode()).hexdigest())"
        )
    problem = text_problem(value)
    if problem:
        raise InvalidInboxMessage(f"message id {value[:40]!r} {problem}")
    return value


def check_text(what: str, value: Any, *, required: bool) -> str | None:
    """An event type or source: None (when not required), or 1 to 255 storable characters."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidInboxMessage(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > MESSAGE_ID_LIMIT:
        raise InvalidInboxMessage(f"{what} must be at most {MESSAGE_ID_LIMIT} characters, got {len(value)}")
    problem = text_problem(value)
    if problem:
        raise InvalidInboxMessage(f"{what} {value[:40]!r} {problem}")
    return value


def check_sent_at(value: Any) -> datetime | None:
    """An aware datetime in UTC, or None."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidInboxMessage(f"sent_at must be an aware datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidInboxMessage(
            f"sent_at must be an aware datetime, got the naive {value.isoformat()}: "
            "pass one with a tzinfo, e.g. datetime.fromtimestamp(seconds, UTC)"
        )
    return value.astimezone(UTC)


def check_message(message: Any) -> InboxMessage:
    """``message`` with every field checked and its id as text; the same object when nothing changed."""
    if not isinstance(message, InboxMessage):
        raise TypeError(f"the inbox takes an outbox.InboxMessage, got {type(message).__name__}")
    message_id = check_message_id(message.id)
    check_text("event_type", message.event_type, required=True)
    check_text("source", message.source, required=False)
    sent_at = check_sent_at(message.sent_at)
    attempt = message.attempt
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise InvalidInboxMessage(f"attempt counts deliveries from 1, got {attempt!r}")
    if message_id is message.id and sent_at is message.sent_at:
        return message
    return dataclasses.replace(message, id=message_id, sent_at=sent_at)
