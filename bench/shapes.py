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

SHAPES = ("today", "today_no_history", "narrow", "narrow_no_history", "rawqueue")

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
    if narrow:
        with psycopg.connect(conninfo(url), autocommit=True) as conn:
            conn.execute(NARROW_TABLE)
    seconds = claim_and_complete(
        url,
        batch_size=batch_size,
        claim_sql=NARROW_CLAIM if narrow else CLAIM,
        delivered_sql=NARROW_DELIVERED if narrow else DELIVERED,
        history=history,
    )
    _check(url, "outbox_state" if narrow else "outbox_message", count, history_rows=count if history else 0)
    return count / seconds


def _check(url: URL, table: str, count: int, *, history_rows: int) -> None:
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute(
            f"""SELECT (SELECT count(*) FROM {table}),
                       (SELECT count(*) FROM {table}
                         WHERE status = 'delivered' AND attempts = 1 AND locked_by IS NULL),
                       (SELECT count(*) FROM outbox_attempt WHERE relay_id = %s AND outcome = 'delivered'),
                       (SELECT count(DISTINCT message_id) FROM outbox_attempt)""",
            (RELAY_ID,),
        ).fetchone()
    expected = (count, count, history_rows, history_rows)
    if row != expected:
        what = "(rows, completed once, history rows, their messages)"
        raise Unverified(f"{table}: {what} = {row}, not {expected}")


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
