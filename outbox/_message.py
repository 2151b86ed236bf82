"""What a handler receives, and the shapes a handler may take."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeAlias

__all__ = ["Handler", "Message"]


@dataclass(frozen=True, slots=True)
class Message:
    """One delivery of one event to one route, as the relay hands it to a handler.

    ``id`` is the ``outbox_message`` row (one per route); ``event_id`` is shared by
    every route's copy of the same event. ``attempt`` counts from 1. ``key`` is
    the idempotency key, stable across retries: use it (or ``id``) to make the
    handler's side effect idempotent. ``expires_at`` is when the message stops
    being worth sending (None: never); a relay hands no handler a message it
    claimed past that time, so a handler may use it to bound its own waiting.
    """

    id: int
    event_id: uuid.UUID
    event_type: str
    handler: str
    payload: Any
    headers: Mapping[str, str] = field(default_factory=dict)
    key: str | None = None
    group_key: str | None = None
    attempt: int = 1
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    created_at: datetime | None = None
    expires_at: datetime | None = None


#: A handler is any callable taking a Message: a plain function (run in a worker
#: thread) or a coroutine function (run on the relay's event loop).
Handler: TypeAlias = Callable[[Message], None] | Callable[[Message], Awaitable[None]]
