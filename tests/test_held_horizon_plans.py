"""While a transaction holds back the xmin horizon, the relay's writes still find their rows by id.

Every row a relay ever claimed left an entry for its ``running`` version in
``ix_outbox_message_status_handler``, and while the horizon is held none of
them may go. The statistics count live rows only, so the planner judged
``status = 'running'`` a cheap way in, and a plan made then was kept for the
session: a pressure run's outcome writes read 339,569 such entries a batch
(migration ``outbox_0025``). These tests build that state for real (a held
transaction id; plans kept while the table was small; thousands of rows run
and finished after them) and read, through ``auto_explain``, the plans the
functions then run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from bench.harness import function_plans

RELAY = "relay-under-test"
#: Rows run and finished after the horizon was pinned: their ``running`` entries stay.
FINISHED_UNDER_HOLD = 5000
#: PL/pgSQL plans a statement afresh for its first five calls, then may keep a generic plan.
CALLS_BEFORE_GENERIC = 6
#: The rows those first calls name, a few each: a relay's first outcomes meet a small table.
EARLY_BATCH = 5
RUNNING = CALLS_BEFORE_GENERIC * EARLY_BATCH
#: The rows the call under test names, running once the table has grown.
BATCH = 50

_INSERT_RUNNING = """
INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,
                            status, attempts, max_attempts, locked_by, locked_until,
                            available_at, created_at, updated_at)
SELECT gen_random_uuid(), 'e', 'h' || (g %% 3), 'default', 0, '{}', '{}', 'running', 1, 5,
       %(me)s, now() + interval '1 hour', now(), now(), now()
  FROM generate_series(1, %(count)s) AS g
RETURNING id
"""


def _conninfo(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def held_horizon(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A database whose horizon an idle transaction holds, statistics taken while it was empty, and
    :data:`RUNNING` rows running; yields a connection (autocommit)."""
    info = _conninfo(pg_url)
    holder = psycopg.connect(info)
    holder.execute("SELECT txid_current()")  # idle in transaction from here on
    conn = psycopg.connect(info, autocommit=True)
    try:
        conn.execute("VACUUM ANALYZE outbox_message")  # empty, as a relay's first plans find it
        conn.execute(_INSERT_RUNNING, {"me": RELAY, "count": RUNNING})
        yield conn
        held = holder.execute("SELECT txid_current() IS NOT NULL").fetchone()
        assert held == (True,)  # the same transaction all along
    finally:
        conn.close()
        holder.close()


def _grow_under_the_hold(conn: psycopg.Connection[Any]) -> list[int]:
    """Rows run and finished after the horizon was pinned, as a relay's deliveries leave them,
    then :data:`BATCH` more running; returns their ids.

    Neither ANALYZE nor VACUUM runs after it, so a plan PL/pgSQL kept for the
    session stays the one made while the table was small (as it does for a
    relay's session between autovacuum's visits, and where autovacuum is off).
    """
    finished = [r[0] for r in conn.execute(_INSERT_RUNNING, {"me": RELAY, "count": FINISHED_UNDER_HOLD})]
    conn.execute(
        "UPDATE outbox_message SET status = 'delivered', locked_by = NULL, locked_until = NULL,"
        " delivered_at = now() WHERE id = ANY(%s)",
        (finished,),
    )
    return sorted(r[0] for r in conn.execute(_INSERT_RUNNING, {"me": RELAY, "count": BATCH}))


def _early_calls(
    conn: psycopg.Connection[Any], call: str, params: Callable[[list[int]], dict[str, Any]]
) -> None:
    """The calls a relay makes while its table is small, each naming a few rows still running."""
    ids = [r[0] for r in conn.execute("SELECT id FROM outbox_message WHERE status = 'running' ORDER BY id")]
    assert len(ids) == RUNNING
    for n in range(CALLS_BEFORE_GENERIC):
        conn.execute(call, params(ids[n * EARLY_BATCH : (n + 1) * EARLY_BATCH]))


def _statement_plans(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> str:
    return "\n\n".join("\n".join(p.lines) for p in function_plans(conn, sql, params))


def _delivered(ids: list[int]) -> str:
    now = time.time()
    return json.dumps(
        [
            {
                "id": i,
                "attempt": 1,
                "status": "delivered",
                "outcome": "delivered",
                "error": None,
                "error_type": None,
                "delay": 0.0,
                "refund": 0,
                "started": now - 0.01,
                "finished": now,
                "duration_ms": 10,
                "detail": {},
            }
            for i in ids
        ]
    )


_SCANNED = re.compile(r"Scan .*\bon outbox_message\b.*\(actual time=\S+ rows=(\d+) loops=(\d+)\)")


def _assert_by_id(plans: str) -> None:
    """Each statement reached its rows through the primary key, and read no more than it named."""
    assert "ix_outbox_message_status_handler" not in plans, plans
    assert "ix_outbox_message_lease" not in plans, plans  # running rows by lease: the same dead entries
    assert "Seq Scan on outbox_message" not in plans, plans
    assert "pk_outbox_message" in plans, plans
    # A full scan of the key (a hash join's build side) names every version the table keeps.
    read = sum(int(rows) * int(loops) for rows, loops in _SCANNED.findall(plans))
    assert 0 < read <= 3 * BATCH, plans


def test_outcome_writes_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    call = "SELECT outbox_complete(%(me)s::text, %(batch)s::jsonb)"
    _early_calls(conn, call, lambda ids: {"me": RELAY, "batch": _delivered(ids)})
    batch = _grow_under_the_hold(conn)
    _assert_by_id(_statement_plans(conn, call, {"me": RELAY, "batch": _delivered(batch)}))
    # and the outcomes were written: the plan that reads by id is the one that did the work
    delivered = conn.execute(
        "SELECT count(*) FROM outbox_message WHERE status = 'delivered' AND id = ANY(%s)", (batch,)
    ).fetchone()
    assert delivered == (BATCH,)


def test_lease_renewals_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    call = "SELECT * FROM outbox_extend(%(me)s::text, %(ids)s::bigint[], 30.0)"
    _early_calls(conn, call, lambda ids: {"me": RELAY, "ids": ids})
    batch = _grow_under_the_hold(conn)
    _assert_by_id(_statement_plans(conn, call, {"me": RELAY, "ids": batch}))
    kept = conn.execute(call, {"me": RELAY, "ids": batch}).fetchall()
    assert sorted(r[0] for r in kept) == batch


def test_releases_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    call = "SELECT outbox_release(%(me)s::text, %(ids)s::bigint[], %(attempts)s::integer[])"
    _early_calls(conn, call, lambda ids: {"me": RELAY, "ids": ids, "attempts": [1] * len(ids)})
    batch = _grow_under_the_hold(conn)
    _assert_by_id(_statement_plans(conn, call, {"me": RELAY, "ids": batch, "attempts": [1] * BATCH}))
    pending = conn.execute(
        "SELECT count(*) FROM outbox_message WHERE status = 'pending' AND id = ANY(%s)", (batch,)
    ).fetchone()
    assert pending == (BATCH,)
