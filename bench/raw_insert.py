"""The floor under mode 1: the outbox row written with raw psycopg 3, no ORM, no outbox code.

Each call is one transaction: one ``INSERT`` of the row ``emit()`` stores for
the ``noop`` route (the same columns, values, casts and ``ON CONFLICT`` clause
as the outbox's own psycopg statement), then ``COMMIT``. Its time, beside what
an ``emit()`` adds to an ORM transaction, shows how much of that cost is the
write itself and how much is the library around it. The rows go to a route
name no other kind uses, so the emit mode's check can tell them apart.
"""

from __future__ import annotations

import json
import uuid

import psycopg
from sqlalchemy.engine import URL

from outbox._outbox import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE

from .app import EVENTS
from .harness import conninfo

__all__ = ["RAW_ROUTE", "RawInserter"]

#: The ``handler`` of the raw rows: not a route, only a label the check counts.
RAW_ROUTE = "raw"

_INSERT = (
    "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
    " aggregate_type, aggregate_id, idempotency_key, group_key, max_attempts, created_at, updated_at,"
    " available_at) VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s, %s, %s,"
    " now(), now(), now() + %s * interval '1 second')"
    " ON CONFLICT (handler, idempotency_key) DO NOTHING"
)


class RawInserter:
    """One open psycopg connection, as a pool would keep it; one transaction per ``insert``."""

    def __init__(self, url: URL) -> None:
        self._conn = psycopg.connect(conninfo(url))

    def insert(self, n: int) -> None:
        """What an application hand-writing its outbox row pays: build the row, INSERT, COMMIT."""
        payload = json.dumps({"n": n, "order": f"order {n}"}, separators=(",", ":"))
        self._conn.execute(
            _INSERT,
            (
                uuid.uuid4(),
                EVENTS["noop"],
                RAW_ROUTE,
                DEFAULT_QUEUE,
                DEFAULT_PRIORITY,
                payload,
                "{}",
                None,
                None,
                None,
                None,
                DEFAULT_MAX_ATTEMPTS,
                0.0,
            ),
        )
        self._conn.commit()

    def close(self) -> None:
        self._conn.close()
