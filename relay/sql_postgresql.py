"""The relay's hot-path SQL on PostgreSQL, as SQL.

Each statement is one autocommit round trip: the claim is a single
``UPDATE ... WHERE id = ANY(ARRAY(SELECT ... FOR UPDATE SKIP LOCKED)) RETURNING``, and a
whole batch of outcomes (message updates and their history rows) is one
statement, atomic because it is one statement. The batch travels as one JSON
document (``jsonb_to_recordset``): encoding it is one C call, where a dozen
typed arrays cost psycopg a Python loop per element, three times the write's
own time.

History rows are inserted ``ON CONFLICT (message_id, attempt, outcome, started_at) DO
NOTHING``: a batch whose COMMIT went through but whose reply was lost is sent again, and
that unique index keeps its rows from being appended twice (its message updates no longer
match, so they do nothing). The conflict is named: any other clash, such as an id taken
ahead of the sequence, fails the write loudly instead of dropping an attempt's row.

An outcome applies only to the claim that produced it (same relay, same
attempt number): a late outcome of an attempt whose lease was recovered must
not finish the message's next attempt.

The claimed ids are gathered into an array first: with ``id IN (subquery)``
PostgreSQL may hash-join the batch against a sequential scan of the whole table
(every delivered row included, so each claim slows as the table grows);
``id = ANY(ARRAY(...))`` is evaluated once and probes the primary key.

A lease runs from the moment its row is taken (``clock_timestamp()``), not
from the statement's start (``now()``): a claim slowed by load must not hand
out leases that are already spent.

A paused queue or handler (``outbox_pause``) is left out of the claim itself,
so no extra round trip is made and a pause is seen by the next claim of every
relay. The queue's pause does not refer to the candidate row: PostgreSQL
evaluates it once per claim. The handler's pause is an anti-join against a
table of a few rows (usually none). It is not written ``c.handler <>
ALL(ARRAY(...))``: against a large table with statistics, the planner's row
estimate for that form made its cost high enough to switch JIT compilation on,
and every claim paid for it (hundreds of milliseconds at a million pending
rows). The relay's own connections also run with ``jit = off``: its statements
are short, and compiling one costs more than running it.

The claim starts its scan at ``(from_priority, from_id)`` in the claim
index's order (``relay/claim_position.py`` says when that is not the front):
a row comparison on the index's columns after ``queue``, which PostgreSQL
turns into the index scan's starting point. The front is the smallest
position there is, not a second statement, so one prepared statement serves
both.

Status values are literals, never parameters: psycopg prepares a statement
after a few executions and PostgreSQL may then switch to a generic plan, which
can only use the partial indexes (``WHERE status = 'pending'``) if the
predicate is spelled out in the query text.
"""

from __future__ import annotations

from .claim_position import FRONT, Position

__all__ = ["CLAIM", "COMPLETE", "PENDING_QUEUES", "claim_sql", "claim_start"]

# Empty headers (most messages) come back as NULL: nothing for the relay to decode.
_COLUMNS = (
    "id, event_id, event_type, handler, queue, priority, payload, NULLIF(headers, '{}'::jsonb) AS headers,"
    " idempotency_key, group_key, attempts, max_attempts, aggregate_type, aggregate_id, created_at"
)

_CLAIM = """
UPDATE outbox_message
   SET status = 'running', locked_by = %(me)s,
       locked_until = clock_timestamp() + %(lease)s * interval '1 second',
       attempts = attempts + 1, updated_at = now()
 WHERE id = ANY(ARRAY(
        SELECT c.id FROM outbox_message c
         WHERE c.status = 'pending' AND c.queue = %(queue)s AND c.handler = ANY(%(handlers)s)
           AND (c.priority, c.id) >= (%(from_priority)s::int, %(from_id)s::bigint)
           AND c.available_at <= now()
           AND NOT EXISTS (SELECT 1 FROM outbox_pause p WHERE p.kind = 'queue' AND p.name = %(queue)s)
           AND NOT EXISTS (SELECT 1 FROM outbox_pause p WHERE p.kind = 'handler' AND p.name = c.handler)
           AND (c.group_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM outbox_message e
                 WHERE e.handler = c.handler AND e.group_key = c.group_key AND e.id < c.id
                   AND e.status IN ({holding})))
         ORDER BY c.priority, c.id
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED))
RETURNING {columns}
"""


def claim_sql(block_on_dead: bool) -> str:
    holding = "'pending', 'running', 'dead'" if block_on_dead else "'pending', 'running'"
    return _CLAIM.format(holding=holding, columns=_COLUMNS)


CLAIM = claim_sql(True)


def claim_start(start: Position) -> dict[str, int]:
    """The claim's ``from_priority`` and ``from_id`` parameters: where its scan starts (None: the front)."""
    from_priority, from_id = start or FRONT
    return {"from_priority": from_priority, "from_id": from_id}


COMPLETE = """
WITH outcome AS (
    SELECT * FROM jsonb_to_recordset(%(batch)s::jsonb)
        AS o(id bigint, attempt int, status text, outcome text, error text, error_type text, delay float8,
             refund int, started timestamptz, finished timestamptz, duration_ms int, detail jsonb)
), updated AS (
    UPDATE outbox_message m
       SET status = o.status,
           delivered_at = CASE WHEN o.status = 'delivered' THEN now() ELSE m.delivered_at END,
           available_at = CASE WHEN o.status = 'pending' THEN now() + o.delay * interval '1 second'
                               ELSE m.available_at END,
           last_error = CASE WHEN o.status = 'delivered' THEN m.last_error ELSE o.error END,
           attempts = m.attempts - o.refund,
           locked_by = NULL, locked_until = NULL, updated_at = now()
      FROM outcome o
     WHERE m.id = o.id AND m.locked_by = %(me)s AND m.status = 'running' AND m.attempts = o.attempt
)
INSERT INTO outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,
                            relay_id, error_type, error, detail)
SELECT o.id, o.attempt, o.outcome, o.started, o.finished, o.duration_ms, %(me)s,
       o.error_type, o.error, o.detail
  FROM outcome o
    ON CONFLICT (message_id, attempt, outcome, started_at) DO NOTHING
"""

#: Distinct queues with pending rows: a loose index scan (one probe per queue) of the claim index.
PENDING_QUEUES = """
WITH RECURSIVE q(queue) AS (
    SELECT min(queue) FROM outbox_message WHERE status = 'pending'
    UNION ALL
    SELECT (SELECT min(queue) FROM outbox_message WHERE status = 'pending' AND queue > q.queue)
      FROM q WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL
"""
