"""``python -m bench.purge``: the audited purge of a day of history, by partition and row by row.

Two databases on the bench server (``OUTBOX_BENCH_DATABASE_URL`` or
``--database-url``), both dropped at the end:

- **partitioned** (migrated to the head, ``outbox_0024``): one day, three days
  ago, holds ``--rows`` history rows, ``--kept`` of them the history of pending
  messages (which a purge keeps). ``outbox.ops.purge`` with
  ``history_older_than=2 days`` is timed: it drops the day's partition, after
  setting the kept rows aside in the DEFAULT partition.
- **row by row** (migrated to ``outbox_0023``, the schema before partitions,
  whose purge deletes history in batches of ``--batch`` rows): the same day
  with ``--delete-rows`` rows, the same ``ops.purge`` timed.

Both fills are ``INSERT ... SELECT generate_series`` as the tables' owner
(the login of the URL), followed by ``VACUUM (ANALYZE)`` of history, which
autovacuum has done long before a day is old enough to purge. After each
purge ``pgstattuple`` counts the dead tuples left in what remains of history
(each partition, or the one table): a lower bound for the row-by-row purge,
whose later batches already prune some of the pages earlier ones emptied. Beside each purge a writer appends a
history row every 10 ms, as relays would, and each write is timed: the
longest says how long the purge held history writes up. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg
from sqlalchemy.engine import URL, make_url

import outbox
from outbox import ops

from .harness import conninfo, engine_for

#: The history of this many days ago is purged; a two-day purge reaches it whole.
DAYS_AGO = 3
PURGE_AGE = timedelta(days=2)


def _admin(server: URL) -> psycopg.Connection[Any]:
    return psycopg.connect(conninfo(server.set(database="postgres")), autocommit=True)


def _create(server: URL, name: str) -> URL:
    with _admin(server) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
        conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    return server.set(database=name)


def _drop(server: URL, name: str) -> None:
    with _admin(server) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _fill(url: URL, *, rows: int, kept: int, day: date, partitioned: bool) -> dict[str, float]:
    """``rows`` history rows spread over ``day``; the first ``kept`` belong to pending messages."""
    began = time.monotonic()
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        if partitioned:
            conn.execute("SELECT outbox_attempt_partition_for(%s)", (day,))
        # Pending messages, whose history a purge keeps; the other rows' messages are long purged.
        conn.execute(
            "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
            " max_attempts, available_at, created_at, updated_at)"
            " SELECT gen_random_uuid(), 'bench.kept', 'h', 'default', 0, '{}', '{}', 5, now(), now(), now()"
            " FROM generate_series(1, %s)",
            (kept,),
        )
        first = conn.execute("SELECT coalesce(min(id), 0) FROM outbox_message").fetchone()
        assert first is not None
        step = 86_400_000_000 // max(rows, 1)  # microseconds between rows, across the whole day
        conn.execute(
            "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,"
            " relay_id, detail)"
            " SELECT CASE WHEN g <= %(kept)s THEN %(first)s + g - 1 ELSE 1000000000 + g END, 1,"
            "        CASE WHEN g <= %(kept)s THEN 'retry' ELSE 'delivered' END,"
            "        %(start)s + (g - 1) * %(step)s * interval '1 microsecond',"
            "        %(start)s + ((g - 1) * %(step)s + 1500) * interval '1 microsecond', 2, 'bench-relay-1',"
            "        '{\"status\": 200}'"
            "   FROM generate_series(1, CAST(%(rows)s AS bigint)) g",
            {
                "kept": kept,
                "first": first[0],
                "start": datetime(day.year, day.month, day.day, tzinfo=UTC),
                "step": step,
                "rows": rows,
            },
        )
        filled = time.monotonic()
        conn.execute("VACUUM (ANALYZE) outbox_attempt")
        conn.execute("CHECKPOINT")
    return {"fill_s": filled - began, "vacuum_s": time.monotonic() - filled}


def _dead_tuples(url: URL) -> dict[str, int]:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r'"
                " AND (c.relname = 'outbox_attempt' OR c.relname ~ '^outbox_attempt_(p[0-9]{8}|default)$')"
            )
        ]
        found = {}
        for table in tables:
            row = conn.execute("SELECT dead_tuple_count FROM pgstattuple(%s)", (table,)).fetchone()
            assert row is not None
            found[table] = int(row[0])
        return found


def _history_rows(url: URL) -> int:
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_attempt").fetchone()
        assert row is not None
        return int(row[0])


class _Writer(threading.Thread):
    """History writes beside the purge, as a relay's would be: one row every 10 ms, each timed."""

    def __init__(self, url: URL) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.latencies: list[float] = []

    def run(self) -> None:
        with psycopg.connect(conninfo(self.url), autocommit=True) as conn:
            n = 0
            while not self.stop.is_set():
                n += 1
                began = time.monotonic()
                conn.execute(
                    "INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at)"
                    " VALUES (%s, 1, 'delivered', now(), now())",
                    (2_000_000_000 + n,),
                )
                self.latencies.append(time.monotonic() - began)
                self.stop.wait(0.01)


def _purge(url: URL, batch: int) -> dict[str, Any]:
    engine = engine_for(url)
    writer = _Writer(url)
    writer.start()
    try:
        time.sleep(0.2)
        began = time.monotonic()
        result = ops.purge(
            engine, delivered_older_than=timedelta(days=365), history_older_than=PURGE_AGE, batch_size=batch
        )
        took = time.monotonic() - began
        time.sleep(0.2)
    finally:
        writer.stop.set()
        writer.join()
        engine.dispose()
    waits = sorted(writer.latencies)
    return {
        "purge_s": took,
        "deleted": result.attempts,
        "steps": result.batches,
        "beside_writes": len(waits),
        "beside_write_ms_max": waits[-1] * 1000 if waits else None,
        "beside_write_ms_p50": waits[len(waits) // 2] * 1000 if waits else None,
    }


def _fill_and_purge(
    server: URL, name: str, revision: str | None, *, rows: int, kept: int, day: date, batch: int
) -> tuple[dict[str, float], dict[str, Any]]:
    """A database at ``revision`` (None: head; ``outbox_0023``: history in one table), filled with a
    day of history and purged; returns the fill's figures and the purge's, with what it left."""
    url = _create(server, name)
    try:
        outbox.upgrade(url.render_as_string(hide_password=False), *([revision] if revision else []))
        fill = _fill(url, rows=rows, kept=kept, day=day, partitioned=revision is None)
        done = _purge(url, batch)
        # Dead tuples first: counting the rows reads every page, and reading prunes some.
        done["dead_tuples_left"] = sum(_dead_tuples(url).values())
        done["rows_left"] = _history_rows(url) - done["beside_writes"]
        return fill, done
    finally:
        _drop(server, name)


def measure(server: URL, *, rows: int, delete_rows: int, kept: int, batch: int, name: str) -> dict[str, Any]:
    day = datetime.now(UTC).date() - timedelta(days=DAYS_AGO)
    figures: dict[str, Any] = {"rows": rows, "delete_rows": delete_rows, "kept": kept, "batch": batch}
    figures["partitioned_fill"], figures["partitioned"] = _fill_and_purge(
        server, f"{name}_partitioned", None, rows=rows, kept=kept, day=day, batch=batch
    )
    if delete_rows:
        figures["rowwise_fill"], figures["rowwise"] = _fill_and_purge(
            server, f"{name}_rowwise", "outbox_0023", rows=delete_rows, kept=kept, day=day, batch=batch
        )
        per_row = figures["rowwise"]["purge_s"] / max(figures["rowwise"]["deleted"], 1)
        figures["rowwise_us_per_row"] = per_row * 1e6
        figures["rowwise_s_at_rows_extrapolated"] = per_row * rows
    with psycopg.connect(conninfo(server.set(database="postgres"))) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        figures["server_version"] = row[0] if row else None
    figures["load_before"] = os.getloadavg()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.purge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_BENCH_DATABASE_URL"))
    parser.add_argument("--rows", type=int, default=10_000_000, help="history rows in the purged day")
    parser.add_argument("--delete-rows", type=int, default=1_000_000, help="rows purged row by row (0: skip)")
    parser.add_argument("--kept", type=int, default=1000, help="rows of pending messages' history")
    parser.add_argument("--batch", type=int, default=10_000, help="purge batch size")
    parser.add_argument("--database", default=None, help="name prefix of the two databases")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOX_BENCH_DATABASE_URL")
    server = make_url(args.database_url).set(drivername="postgresql+psycopg")
    name = args.database or f"outbox_bench_purge_{uuid.uuid4().hex[:8]}"
    figures = measure(
        server, rows=args.rows, delete_rows=args.delete_rows, kept=args.kept, batch=args.batch, name=name
    )
    json.dump(figures, sys.stdout, indent=2, default=str)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
