"""Mode ``shapes`` (opt-in): what the table's shape, not the relay, allows against the raw queue.

Issue 16 asks the relay for half the raw queue's rate (``bench/rawqueue.py``:
one narrow table, one statement and one commit per batch, no history). The
relay reaches most of its own ceiling (mode 3), so this asks how far the
ceiling itself can move. The same hand-written claim/complete loop as mode 3
(``ceiling.claim_and_complete``: a committed claim, then the outcome) runs on
four shapes, and the raw queue beside them:

- ``today``: ``outbox_message`` as it is, one history row per attempt (mode 3);
- ``today_no_history``: the same without the history row;
- ``narrow``: the mutable state (status, attempts, lease, due time, group)
  moved to a narrow ``outbox_state`` table beside an unchanging
  ``outbox_message``, with the claim's and the status's partial indexes on
  it; the claim joins back for the message's columns; with history;
- ``narrow_no_history``: the same without the history row;
- ``moved``: ``outbox_message`` as it is while a message is unfinished; its
  delivery moves the row into ``outbox_done``, range-partitioned by the day it
  was delivered (``DELETE ... RETURNING`` feeding an ``INSERT``), so retention
  drops a day instead of deleting it; with history. The row is no longer the
  target of a foreign key (a partitioned table's key must hold its partition
  key), so the self-referencing ``requeued_from`` key is dropped;
- ``narrow_moved``: the narrow state table, whose row is deleted when its
  message is delivered (the unchanging message row stays, for a retention by
  its creation day); with history;
- ``rawqueue``: mode 16's raw queue, one worker.

A prototype only: nothing reads ``outbox_state`` but this loop. Each shape runs
``rounds`` times on a fresh database, in an order reversed every round, and
reports its median; each run is checked (every message completed once, one
history row each where the shape writes one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.engine import URL

from .ceiling import CLAIM, DELIVERED, RELAY_ID, claim_and_complete
from .harness import Scratch, conninfo, prefill
from .rawqueue import rawqueue
from .verify import Unverified

__all__ = ["SHAPES", "shapes", "shapes_mode", "targets"]

SHAPES = ("today", "today_no_history", "narrow", "narrow_no_history", "moved", "narrow_moved", "rawqueue")

NARROW_TABLE = """
CREATE TABLE outbox_state (
    id bigint PRIMARY KEY REFERENCES outbox_message (id),
    queue varchar(255) NOT NULL,
    handler varchar(255) NOT NULL,
    priority integer NOT NULL,
    group_key varchar(255),
    status varchar(16) NOT NULL,
    attempts integer NOT NULL,
    max_attempts integer NOT NULL,
    available_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    locked_by varchar(255),
    locked_until timestamptz,
    delivered_at timestamptz
);
INSERT INTO outbox_state
SELECT id, queue, handler, priority, group_key, status, attempts, max_attempts, available_at, updated_at,
       locked_by, locked_until, delivered_at
FROM outbox_message;
CREATE INDEX ix_outbox_state_claim ON outbox_state (queue, priority, id) WHERE status = 'pending';
CREATE INDEX ix_outbox_state_status ON outbox_state (status, handler)
    WHERE status = 'pending' OR status = 'running' OR status = 'dead' OR status = 'discarded';
CREATE INDEX ix_outbox_state_group ON outbox_state (handler, group_key, id) WHERE group_key IS NOT NULL;
ANALYZE outbox_state;
"""

#: Mode 3's claim on the narrow table, joined back for the columns a handler's Message needs.
NARROW_CLAIM = (
    "WITH claimed AS ("
    + CLAIM.replace("outbox_message", "outbox_state").split("RETURNING")[0]
    + """RETURNING id, attempts, max_attempts)
SELECT m.id, m.event_id, m.event_type, m.handler, m.queue, m.priority, m.payload, m.headers,
       m.idempotency_key, m.group_key, c.attempts, c.max_attempts, m.aggregate_type, m.aggregate_id,
       m.created_at
FROM claimed AS c JOIN outbox_message AS m USING (id)
"""
)
NARROW_DELIVERED = DELIVERED.replace("outbox_message", "outbox_state")

#: Delivered messages leave the queue table for a table of one partition a day (today's and
#: tomorrow's made ahead), keyed as a partitioned table must be: by id and the partition key.
DONE_TABLE = """
ALTER TABLE outbox_message DROP CONSTRAINT fk_outbox_message_requeued_from_outbox_message;
CREATE TABLE outbox_done (LIKE outbox_message) PARTITION BY RANGE (delivered_at);
ALTER TABLE outbox_done ADD PRIMARY KEY (id, delivered_at);
CREATE TABLE outbox_done_today PARTITION OF outbox_done
    FOR VALUES FROM (date_trunc('day', now())) TO (date_trunc('day', now()) + interval '1 day');
CREATE TABLE outbox_done_tomorrow PARTITION OF outbox_done
    FOR VALUES FROM (date_trunc('day', now()) + interval '1 day')
    TO (date_trunc('day', now()) + interval '2 days');
"""

#: The columns a delivery changes; every other column moves as it is.
_DELIVERY = {
    "status": "'delivered'",
    "delivered_at": "now()",
    "locked_by": "NULL",
    "locked_until": "NULL",
    "updated_at": "now()",
}


def moved_delivered(columns: list[str]) -> str:
    """``DELIVERED`` for the ``moved`` shape: the running rows of the batch leave the queue table."""
    values = ", ".join(_DELIVERY.get(column, f"gone.{column}") for column in columns)
    return f"""
WITH gone AS (
    DELETE FROM outbox_message
    WHERE id = ANY(%(ids)s) AND locked_by = %(relay)s AND status = 'running'
    RETURNING *)
INSERT INTO outbox_done ({", ".join(columns)})
SELECT {values} FROM gone
"""


NARROW_MOVED_DELIVERED = """
DELETE FROM outbox_state WHERE id = ANY(%(ids)s) AND locked_by = %(relay)s AND status = 'running'
"""

#: Per shape: the table its delivered rows end in (None: none, their state is gone) and the
#: table a delivery empties (None: none).
_ENDS: dict[str, tuple[str | None, str | None]] = {
    "today": ("outbox_message", None),
    "today_no_history": ("outbox_message", None),
    "narrow": ("outbox_state", None),
    "narrow_no_history": ("outbox_state", None),
    "moved": ("outbox_done", "outbox_message"),
    "narrow_moved": (None, "outbox_state"),
}


def shapes(scratch: Scratch, *, count: int, batch_size: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[float]] = {shape: [] for shape in SHAPES}
    for i in range(rounds):
        for shape in SHAPES if i % 2 == 0 else SHAPES[::-1]:
            scratch.settle()
            purpose = f"shape{i + 1}{shape.replace('_', '')}"
            runs[shape].append(_run(scratch, shape, purpose, count, batch_size))
    return {"count": count, "runs": runs, "per_s": {shape: statistics.median(r) for shape, r in runs.items()}}


def _run(scratch: Scratch, shape: str, purpose: str, count: int, batch_size: int) -> float:
    if shape == "rawqueue":
        rate: float = rawqueue(scratch, workers=1, count=count)["per_s"]
        return rate
    url = scratch.postgres(purpose)
    prefill(url, "noop", count)
    narrow = shape.startswith("narrow")
    history = not shape.endswith("no_history")
    delivered_sql = NARROW_DELIVERED if narrow else DELIVERED
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        if narrow:
            conn.execute(NARROW_TABLE)
        if shape == "moved":
            conn.execute(DONE_TABLE)
            columns = conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = 'outbox_message'::regclass"
                " AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
            ).fetchall()
            delivered_sql = moved_delivered([column for (column,) in columns])
        if shape == "narrow_moved":
            delivered_sql = NARROW_MOVED_DELIVERED
    seconds = claim_and_complete(
        url,
        batch_size=batch_size,
        claim_sql=NARROW_CLAIM if narrow else CLAIM,
        delivered_sql=delivered_sql,
        history=history,
    )
    finished, emptied = _ENDS[shape]
    _check(url, count, finished=finished, emptied=emptied, history_rows=count if history else 0)
    return count / seconds


def _check(url: URL, count: int, *, finished: str | None, emptied: str | None, history_rows: int) -> None:
    """Every message completed once: in ``finished`` as delivered on its first attempt, gone from
    ``emptied``, and with one history row each where the shape writes one."""
    delivered = "status = 'delivered' AND attempts = 1 AND locked_by IS NULL"
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            f"""SELECT {f"(SELECT count(*) FROM {finished})" if finished else count},
                       {f"(SELECT count(*) FROM {finished} WHERE {delivered})" if finished else count},
                       {f"(SELECT count(*) FROM {emptied})" if emptied else 0},
                       (SELECT count(*) FROM outbox_attempt WHERE relay_id = %s AND outcome = 'delivered'),
                       (SELECT count(DISTINCT message_id) FROM outbox_attempt)""",
            (RELAY_ID,),
        ).fetchone()
    expected = (count, count, 0, history_rows, history_rows)
    if row != expected:
        what = "(rows, completed once, rows left unfinished, history rows, their messages)"
        raise Unverified(f"{finished or emptied}: {what} = {row}, not {expected}")


def shapes_mode(
    mode: Callable[[str, Callable[[], dict[str, Any]]], dict[str, Any] | None],
    out: dict[str, Any],
    scratch: Scratch,
    *,
    count: int,
    batch_size: int,
    rounds: int,
) -> None:
    """Run the mode through ``python -m bench``'s ``mode`` runner and add its figures to ``out``."""
    result = mode("table shapes", lambda: shapes(scratch, count=count, batch_size=batch_size, rounds=rounds))
    if not result:
        return
    raw = result["per_s"]["rawqueue"]
    out["shapes_messages"] = result["count"]
    for shape in SHAPES:
        out[f"shapes_per_s_{shape}"] = result["per_s"][shape]
        out[f"shapes_runs_per_s_{shape}"] = ", ".join(f"{rate:.0f}" for rate in result["runs"][shape])
        out[f"shapes_vs_rawqueue_{shape}"] = result["per_s"][shape] / raw


def targets(out: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The mode's rows of the result table (none when it did not run)."""
    if "shapes_per_s_rawqueue" not in out:
        return []
    return [
        (
            f"16 shape: {shape}",
            f"{out[f'shapes_per_s_{shape}']:,.0f} msg/s (median of {out[f'shapes_runs_per_s_{shape}']}), "
            f"{out[f'shapes_vs_rawqueue_{shape}']:.2f} of the raw queue",
            "",
            "-",
        )
        for shape in SHAPES
    ]
