"""The columns the relay reads for a message it hands to a handler: by a claim, or by a lease recovery.

The documents are decoded by the relay itself, so one that cannot be is a
dead message, not a failed claim or recovery (``documents.py``).
"""

from __future__ import annotations

from outbox import outbox_message

from .documents import as_decoded

__all__ = ["CLAIMED"]

m = outbox_message

#: Everything a handler's Message needs.
CLAIMED = (
    m.c.id,
    m.c.event_id,
    m.c.event_type,
    m.c.handler,
    m.c.queue,
    m.c.priority,
    as_decoded(m.c.payload),
    as_decoded(m.c.headers),
    m.c.idempotency_key,
    m.c.group_key,
    m.c.attempts,
    m.c.max_attempts,
    m.c.aggregate_type,
    m.c.aggregate_id,
    m.c.created_at,
    m.c.expires_at,
)
