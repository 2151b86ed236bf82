"""While a transaction holds back the xmin horizon, the relay's writes still find their rows by id.

Every row a relay ever claimed left an entry for its ``running`` version in
``ix_outbox_message_status_handler``, and while the horizon is held none of
them may go. The statistics count live rows only, so the planner judged
``status = 'running'`` a cheap way in, and a plan made then was kept for the
session: a pressure run's outcome writes read 339,569 such entries a batch
(migration ``outbox_0025``). These tests build that state for real (a held
transaction id, thousands of rows run and finished after it) and read, through
``auto_explain``, the plans the functions run once PL/pgSQL keeps a generic one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from bench.harness import function_plans

RELAY = "relay-under-test"
#: Rows run and finished after the horizon was pinned: their ``running`` entries stay.
FINISHED_UNDER_HOLD = 5000
#: Rows still running, the ones the calls name.
RUNNING = 400
BATCH = 50
#: PL/pgSQL plans a statement afresh for its first five calls, then may keep a generic plan.
CALLS_BEFORE_GENERIC = 6

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
    """A database whose horizon an idle transaction holds, thousands of rows run and finished since,
    :data:`RUNNING` rows running now, and statistics that count the live rows only; yields a connection."""
    info = _conninfo(pg_url)
    holder = psycopg.connect(info)
    holder.execute("SELECT txid_current()")  # idle in transaction from here on
    conn = psycopg.connect(info, autocommit=True)
    try:
        finished = [r[0] for r in conn.execute(_INSERT_RUNNING, {"me": RELAY, "count": FINISHED_UNDER_HOLD})]
        conn.execute(
            "UPDATE outbox_message SET status = 'delivered', locked_by = NULL, locked_until = NULL,"
            " delivered_at = now() WHERE id = ANY(%s)",
            (finished,),
        )
        conn.execute(_INSERT_RUNNING, {"me": RELAY, "count": RUNNING})
        conn.execute("ANALYZE outbox_message")  # the statistics count live rows only
        conn.execute("VACUUM outbox_message")  # removes nothing newer than the held xid, and says so
        dead = conn.execute(
            "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_message'"
        ).fetchone()
        assert dead is not None and dead[0] >= FINISHED_UNDER_HOLD  # the hold is real
        yield conn
    finally:
        conn.close()
        holder.close()


def _running_ids(conn: psycopg.Connection[Any]) -> list[int]:
    return [r[0] for r in conn.execute("SELECT id FROM outbox_message WHERE status = 'running' ORDER BY id")]


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


def _assert_by_id(plans: str) -> None:
    assert "ix_outbox_message_status_handler" not in plans, plans
    assert "Seq Scan on outbox_message" not in plans, plans
    assert "using pk_outbox_message on outbox_message" in plans, plans


def test_outcome_writes_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    ids = _running_ids(conn)
    call = "SELECT outbox_complete(%(me)s::text, %(batch)s::jsonb)"
    for n in range(CALLS_BEFORE_GENERIC):
        conn.execute(call, {"me": RELAY, "batch": _delivered(ids[n * BATCH : (n + 1) * BATCH])})
    rest = ids[CALLS_BEFORE_GENERIC * BATCH :]
    _assert_by_id(_statement_plans(conn, call, {"me": RELAY, "batch": _delivered(rest[:BATCH])}))
    # and the outcomes were written: the plan that reads by id is the one that did the work
    delivered = conn.execute(
        "SELECT count(*) FROM outbox_message WHERE status = 'delivered' AND id = ANY(%s)",
        (ids[: (CALLS_BEFORE_GENERIC * BATCH) + BATCH],),
    ).fetchone()
    assert delivered == ((CALLS_BEFORE_GENERIC + 1) * BATCH,)


def test_lease_renewals_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    ids = _running_ids(conn)
    call = "SELECT * FROM outbox_extend(%(me)s::text, %(ids)s::bigint[], 30.0)"
    for n in range(CALLS_BEFORE_GENERIC):
        conn.execute(call, {"me": RELAY, "ids": ids[n * BATCH : (n + 1) * BATCH]})
    plans = _statement_plans(conn, call, {"me": RELAY, "ids": ids[-BATCH:]})
    _assert_by_id(plans)
    kept = conn.execute(call, {"me": RELAY, "ids": ids[-BATCH:]}).fetchall()
    assert sorted(r[0] for r in kept) == ids[-BATCH:]


def test_releases_find_their_rows_by_id(held_horizon: psycopg.Connection[Any]) -> None:
    conn = held_horizon
    ids = _running_ids(conn)
    call = "SELECT outbox_release(%(me)s::text, %(ids)s::bigint[], %(attempts)s::integer[])"
    for n in range(CALLS_BEFORE_GENERIC):
        batch = ids[n * BATCH : (n + 1) * BATCH]
        conn.execute(call, {"me": RELAY, "ids": batch, "attempts": [1] * len(batch)})
    batch = ids[-BATCH:]
    _assert_by_id(_statement_plans(conn, call, {"me": RELAY, "ids": batch, "attempts": [1] * BATCH}))
    pending = conn.execute(
        "SELECT count(*) FROM outbox_message WHERE status = 'pending' AND id = ANY(%s)", (batch,)
    ).fetchone()
    assert pending == (BATCH,)
