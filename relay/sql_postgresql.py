"""The relay's hot-path SQL on PostgreSQL, as SQL.

Each statement is one autocommit round trip: the claim is a single
``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING``, and a
whole batch of outcomes (message updates and their history rows) is one
statement over ``unnest``-ed arrays, atomic because it is one statement.

An outcome applies only to the claim that produced it (same relay, same
attempt number): a late outcome of an attempt whose lease was recovered must
not finish the message's next attempt.

Status values are literals, never parameters: psycopg prepares a statement
after a few executions and PostgreSQL may then switch to a generic plan, which
can only use the partial indexes (``WHERE status = 'pending'``) if the
predicate is spelled out in the query text.
"""

from __future__ import annotations

__all__ = ["CLAIM", "COMPLETE", "PENDING_QUEUES", "claim_sql"]

_COLUMNS = (
    "id, event_id, event_type, handler, queue, priority, payload, headers, idempotency_key, group_key,"
    " attempts, max_attempts, aggregate_type, aggregate_id, created_at"
)

_CLAIM = """
UPDATE outbox_message
   SET status = 'running', locked_by = %(me)s, locked_until = now() + %(lease)s * interval '1 second',
       attempts = attempts + 1, updated_at = now()
 WHERE id IN (
        SELECT c.id FROM outbox_message c
         WHERE c.status = 'pending' AND c.queue = %(queue)s AND c.handler = ANY(%(handlers)s)
           AND c.available_at <= now()
           AND (c.group_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM outbox_message e
                 WHERE e.handler = c.handler AND e.group_key = c.group_key AND e.id < c.id
                   AND e.status IN ({holding})))
         ORDER BY c.priority, c.id
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED)
RETURNING {columns}
"""


def claim_sql(block_on_dead: bool) -> str:
    holding = "'pending', 'running', 'dead'" if block_on_dead else "'pending', 'running'"
    return _CLAIM.format(holding=holding, columns=_COLUMNS)


CLAIM = claim_sql(True)

COMPLETE = """
WITH outcome AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(statuses)s::text[], %(errors)s::text[],
                         %(delays)s::float8[], %(refunds)s::int[])
        AS o(id, attempt, status, error, delay, refund)
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
SELECT h.message_id, h.attempt, h.outcome, h.started_at, h.finished_at, h.duration_ms, %(me)s,
       h.error_type, h.error, h.detail::jsonb
  FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(outcomes)s::text[], %(started)s::timestamptz[],
              %(finished)s::timestamptz[], %(durations)s::int[], %(error_types)s::text[],
              %(errors)s::text[], %(details)s::text[])
    AS h(message_id, attempt, outcome, started_at, finished_at, duration_ms, error_type, error, detail)
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
