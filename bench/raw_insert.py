"""The floor under mode 1: the outbox row written with raw psycopg 3, no ORM, no outbox code.

Each call is one transaction on one open connection:

- ``insert``: one ``INSERT`` of the row ``emit()`` stores for the ``noop``
  route (the same columns, values, casts and ``ON CONFLICT`` clause as the
  outbox's own psycopg statement), then ``COMMIT``;
- ``order``: the domain row alone, as the ORM's flush writes it (``INSERT ...
  RETURNING id``), then ``COMMIT``: a plain psycopg transaction;
- ``enqueue``: the same domain row, then the outbox row, then ``COMMIT``: a
  queue written by hand in the application's transaction;
- ``raw_queue_enqueue``: the same domain row, then a row of the raw queue's
  own narrow table (``bench/rawqueue.py``: a ``jsonb`` payload, its key and one
  partial index), then ``COMMIT``: the simplest correct queue's enqueue.

``enqueue`` minus ``order`` is what a hand-written enqueue adds to a plain
psycopg transaction, the figure to read beside what an ``emit()`` adds to an
ORM one; ``raw_queue_enqueue`` minus ``order`` is what the same costs when the
row is the raw queue's instead of the outbox's: the share of an emit's cost
that is the outbox table's shape. The rows go to route names no other kind uses, so the emit mode's
check can tell them apart.
"""

from __future__ import annotations

import json
import uuid

import psycopg
from sqlalchemy.engine import URL

from outbox._outbox import DEFAULT_MAX_ATTEMPTS, DEFAULT_PRIORITY, DEFAULT_QUEUE

from .app import EVENTS
from .harness import conninfo
from .rawqueue import SCHEMA

__all__ = ["ENQUEUE_ROUTE", "RAW_ROUTE", "RawInserter"]

#: The ``handler`` of the raw rows: not a route, only a label the check counts.
RAW_ROUTE = "raw"
#: The same, for the rows ``enqueue`` writes beside a domain row.
ENQUEUE_ROUTE = "raw_enqueue"

_INSERT = (
    "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
    " aggregate_type, aggregate_id, idempotency_key, group_key, max_attempts, created_at, updated_at,"
    " available_at) VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s, %s, %s,"
    " now(), now(), now() + %s * interval '1 second')"
    " ON CONFLICT (handler, idempotency_key) DO NOTHING"
)
#: The raw queue's enqueue: its payload, nothing else (its table is ``rawqueue.SCHEMA``).
_RAW_QUEUE_INSERT = "INSERT INTO raw_queue (payload) VALUES (%s::jsonb)"
#: What the ORM's flush sends for the benchmark's domain row.
_ORDER = "INSERT INTO bench_order (n, kind, note) VALUES (%s, %s, %s) RETURNING bench_order.id"


class RawInserter:
    """One open psycopg connection, as a pool would keep it; one transaction per ``insert``."""

    def __init__(self, url: URL) -> None:
        self._conn = psycopg.connect(conninfo(url))
        self._conn.execute(SCHEMA)
        self._conn.commit()

    def insert(self, n: int) -> None:
        """What an application hand-writing its outbox row pays: build the row, INSERT, COMMIT."""
        self._outbox_row(n, RAW_ROUTE)
        self._conn.commit()

    def order(self, n: int, kind: str) -> None:
        """A plain psycopg transaction: the domain row, COMMIT."""
        self._conn.execute(_ORDER, (n, kind, f"order {n}")).fetchone()
        self._conn.commit()

    def enqueue(self, n: int, kind: str) -> None:
        """The domain row and, by hand, its outbox row in the same transaction, COMMIT."""
        self._conn.execute(_ORDER, (n, kind, f"order {n}")).fetchone()
        self._outbox_row(n, ENQUEUE_ROUTE)
        self._conn.commit()

    def raw_queue_enqueue(self, n: int, kind: str) -> None:
        """The domain row and a row of the raw queue's table in the same transaction, COMMIT."""
        self._conn.execute(_ORDER, (n, kind, f"order {n}")).fetchone()
        self._conn.execute(_RAW_QUEUE_INSERT, (_payload(n),))
        self._conn.commit()

    def _outbox_row(self, n: int, route: str) -> None:
        payload = _payload(n)
        self._conn.execute(
            _INSERT,
            (
                uuid.uuid4(),
                EVENTS["noop"],
                route,
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

    def close(self) -> None:
        self._conn.close()


def _payload(n: int) -> str:
    """The event's payload as ``emit()`` stores it, for both hand-written rows."""
    return json.dumps({"n": n, "order": f"order {n}"}, separators=(",", ":"))
