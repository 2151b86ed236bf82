"""Set-based fills for the modes that need big tables: the server writes the rows, not Python.

A million rows sent from Python would take longer than the runs they set up,
and would measure the driver; ``INSERT ... SELECT FROM generate_series`` on
the server takes seconds. Every fill ends with ``VACUUM (ANALYZE)`` of the
tables it wrote, so the planner has statistics and index-only scans see
all-visible pages, as they would on a table that has lived for a while.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import URL

from .harness import conninfo

__all__ = ["HISTORY_CHUNK", "fill_history", "fill_session", "vacuum_analyze"]

#: Rows per history transaction: a progress line each, and no single ten-million-row transaction.
HISTORY_CHUNK = 1_000_000


@contextmanager
def fill_session(url: URL) -> Iterator[psycopg.Connection]:
    """An autocommit connection that does not wait for each fill transaction's WAL flush.

    ``synchronous_commit = off`` is this session's setting only: a crash could
    lose the last fill transactions, which a benchmark would simply redo.
    """
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        yield conn


def vacuum_analyze(conn: psycopg.Connection, *tables: str) -> None:
    for table in tables:
        conn.execute(f"VACUUM (ANALYZE) {table}")


# One delivered attempt per message, ``started_at`` spread over the 30 days before the
# last hour, in message order: what the relay wrote for messages that retention has
# since purged. ``outbox_attempt`` has no foreign key to ``outbox_message`` on purpose
# (history may outlive its messages), so these rows need no message rows.
_HISTORY = """
INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms, relay_id)
SELECT g, 1, 'delivered', t, t + d * interval '1 millisecond', d, 'relay-' || (g %% 4)
FROM (
    SELECT g,
           now() - interval '1 hour' - (%(total)s - g) * (interval '30 days' / %(total)s) AS t,
           (5 + abs(hashint8(g)) %% 250)::int AS d
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
) AS rows
"""


def fill_history(url: URL, rows: int, *, progress: bool = False) -> float:
    """Store ``rows`` history rows for messages 1..rows (since purged); return the seconds it took.

    The ``outbox_message`` id sequence is moved past them, so messages stored
    afterwards get higher ids, as newer messages do.
    """
    began = time.monotonic()
    with fill_session(url) as conn:
        for first in range(1, rows + 1, HISTORY_CHUNK):
            last = min(rows, first + HISTORY_CHUNK - 1)
            conn.execute(_HISTORY, {"first": first, "last": last, "total": rows})
            if progress:
                print(f"bench: scale: {last:,} of {rows:,} history rows", file=sys.stderr, flush=True)
        if rows:
            conn.execute("SELECT setval(pg_get_serial_sequence('outbox_message', 'id'), %(n)s)", {"n": rows})
    return time.monotonic() - began
