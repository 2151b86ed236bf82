"""The relay's own writes run inside the database, which stamps their history rows.

Revision ID: outbox_0015
Revises: outbox_0014
Create Date: 2026-12-13

Claims, outcomes, lease renewals, releases and lease recoveries were plain SQL
from the relay's login: that role needed UPDATE on every column of
``outbox_message`` and INSERT on ``outbox_attempt``. With those it could set any
status by hand (bury a dead message as delivered, clear a lineage), append
history for messages it never held, and every history row's ``started_at`` was
its own host's clock, which the purge's one-day floor trusts.

PostgreSQL now does each of them in a ``SECURITY DEFINER`` function owned by
the tables' owner, with ``search_path`` pinned, one call per batch, as before
(one round trip per claim and one per batch of outcomes):

- ``outbox_claim`` leases due rows (the statement the relay ran, unchanged);
- ``outbox_complete`` applies a batch of outcomes (JSON in) and appends their
  history: the relay's own start and finish times are held between the claim's
  time as the row recorded it and the database's clock at the write (a relay
  host whose clock is a day slow cannot make fresh history look old), and
  ``detail.db_user`` is the login. An outcome
  is recorded only for a claim the caller holds, or held until a lease recovery
  took it back (the recovery's row names it): a relay cannot write history for
  a message it never claimed. Statuses and outcomes are the relay's own (no
  ``requeued``, no ``discarded``), and a refund gives back one attempt at most;
- ``outbox_extend`` renews the caller's leases, ``outbox_release`` hands back
  claims whose attempt never started;
- ``outbox_recover`` takes back expired leases the caller names, after checking
  each is still expired under its lock, and writes the ``lease_expired`` row; a
  message on its last attempt goes dead whatever the caller says.

EXECUTE is revoked from PUBLIC; the least-privilege block in docs/operations.md
grants it to the relay and no longer grants that role UPDATE on
``outbox_message`` nor INSERT on ``outbox_attempt``.

PL/pgSQL, not SQL functions: PostgreSQL keeps a PL/pgSQL function's plans for
the session, as it kept the prepared statements they replace.

SQLite has no roles: the relay writes the same rows itself there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0015"
down_revision = "outbox_0014"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"

RELAY_FUNCTIONS = (
    "outbox_claim(text, double precision, text, text[], integer, integer, bigint, boolean)",
    "outbox_complete(text, jsonb)",
    "outbox_extend(text, bigint[], double precision)",
    "outbox_release(text, bigint[], integer[])",
    "outbox_recover(text, jsonb)",
)

_CLAIMED = """m.id, m.event_id, m.event_type::text, m.handler::text, m.queue::text, m.priority, m.payload,
               NULLIF(m.headers, '{}'::jsonb), m.idempotency_key::text, m.group_key::text, m.attempts,
               m.max_attempts, m.aggregate_type::text, m.aggregate_id::text, m.created_at"""


def _claim(s: str, holding: str) -> str:
    return f"""
        RETURN QUERY
        UPDATE {s}.outbox_message m
           SET status = 'running', locked_by = me,
               locked_until = clock_timestamp() + lease * interval '1 second',
               attempts = m.attempts + 1, updated_at = now()
         WHERE m.id = ANY(ARRAY(
                SELECT c.id FROM {s}.outbox_message c
                 WHERE c.status = 'pending' AND c.queue = queue_name AND c.handler = ANY(handlers)
                   AND (c.priority, c.id) >= (from_priority, from_id)
                   AND c.available_at <= now()
                   AND NOT EXISTS (SELECT 1 FROM {s}.outbox_pause p
                                    WHERE p.kind = 'queue' AND p.name = queue_name)
                   AND NOT EXISTS (SELECT 1 FROM {s}.outbox_pause p
                                    WHERE p.kind = 'handler' AND p.name = c.handler)
                   AND (c.group_key IS NULL OR NOT EXISTS (
                        SELECT 1 FROM {s}.outbox_message e
                         WHERE e.handler = c.handler AND e.group_key = c.group_key AND e.id < c.id
                           AND e.status IN ({holding})))
                 ORDER BY c.priority, c.id
                 LIMIT max_rows
                   FOR UPDATE SKIP LOCKED))
        RETURNING {_CLAIMED};"""


def _sql(s: str) -> list[str]:
    """Every function; ``s`` is the quoted schema."""
    return [
        f"""
CREATE FUNCTION {s}.outbox_claim(
    me text, lease double precision, queue_name text, handlers text[], max_rows integer,
    from_priority integer, from_id bigint, block_on_dead boolean
) RETURNS TABLE (
    id bigint, event_id uuid, event_type text, handler text, queue text, priority integer, payload jsonb,
    headers jsonb, idempotency_key text, group_key text, attempts integer, max_attempts integer,
    aggregate_type text, aggregate_id text, created_at timestamptz
) LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
#variable_conflict use_column
BEGIN
    IF me IS NULL OR btrim(me) = '' OR length(me) > 255 THEN
        RAISE EXCEPTION 'outbox claim: a relay id of 1 to 255 characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF block_on_dead THEN
        {_claim(s, "'pending', 'running', 'dead'")}
    ELSE
        {_claim(s, "'pending', 'running'")}
    END IF;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_complete(me text, batch jsonb) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM jsonb_to_recordset(batch) AS o(status text, outcome text, refund int)
         WHERE o.status IS NULL OR o.status NOT IN ('delivered', 'pending', 'dead')
            OR o.outcome IS NULL OR o.outcome NOT IN ('delivered', 'retry', 'failed', 'dead', 'timeout')
            OR (o.status = 'delivered') <> (o.outcome = 'delivered')
            OR coalesce(o.refund, 0) NOT IN (0, 1) OR (o.refund = 1 AND o.status <> 'pending')
    ) THEN
        RAISE EXCEPTION 'outbox complete: an outcome the relay cannot record (status %, outcome %)',
            (SELECT string_agg(DISTINCT coalesce(o.status, 'null'), ', ')
               FROM jsonb_to_recordset(batch) AS o(status text)),
            (SELECT string_agg(DISTINCT coalesce(o.outcome, 'null'), ', ')
               FROM jsonb_to_recordset(batch) AS o(outcome text))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH outcome AS (
        SELECT * FROM jsonb_to_recordset(batch)
            AS o(id bigint, attempt int, status text, outcome text, error text, error_type text,
                 delay float8, refund int, started float8, finished float8, duration_ms int,
                 detail jsonb)
    ), claimed AS (
        -- The rows as the claim left them (this statement's snapshot): updated_at is the claim's time.
        SELECT o.*, m.updated_at AS claimed_at,
               coalesce(m.locked_by = me AND m.status = 'running' AND m.attempts = o.attempt, false) AS ours
          FROM outcome o LEFT JOIN {s}.outbox_message m ON m.id = o.id
    ), updated AS (
        UPDATE {s}.outbox_message m
           SET status = o.status,
               delivered_at = CASE WHEN o.status = 'delivered' THEN now() ELSE m.delivered_at END,
               available_at = CASE WHEN o.status = 'pending'
                                   THEN now() + greatest(o.delay, 0) * interval '1 second'
                                   ELSE m.available_at END,
               last_error = CASE WHEN o.status = 'delivered' THEN m.last_error ELSE o.error END,
               attempts = m.attempts - coalesce(o.refund, 0),
               locked_by = NULL, locked_until = NULL, updated_at = now()
          FROM outcome o
         WHERE m.id = o.id AND m.locked_by = me AND m.status = 'running' AND m.attempts = o.attempt
    ), recorded AS (
        -- A claim still held, or one a lease recovery took back from this relay (a late outcome:
        -- the attempt did happen), recorded once; never a message this relay did not hold.
        SELECT c.*, CASE WHEN c.ours THEN c.claimed_at ELSE x.started_at END AS claim_time
          FROM claimed c
          LEFT JOIN LATERAL (
                SELECT h.started_at FROM {s}.outbox_attempt h
                 WHERE NOT c.ours AND h.message_id = c.id AND h.attempt = c.attempt
                   AND h.outcome = 'lease_expired' AND h.relay_id = me
                 LIMIT 1) x ON true
         WHERE c.ours OR (x.started_at IS NOT NULL AND NOT EXISTS (
                SELECT 1 FROM {s}.outbox_attempt d
                 WHERE d.message_id = c.id AND d.attempt = c.attempt AND d.outcome = c.outcome
                   AND d.relay_id = me))
    )
    -- The relay's own start and finish, held to what the database saw: not before the claim,
    -- not after this write.
    INSERT INTO {s}.outbox_attempt (message_id, attempt, outcome, started_at, finished_at, duration_ms,
                                    relay_id, error_type, error, detail)
    SELECT r.id, r.attempt, r.outcome, t.started, greatest(t.started, least(to_timestamp(r.finished), now())),
           greatest(r.duration_ms, 0), me, r.error_type, r.error,
           CASE WHEN jsonb_typeof(r.detail) = 'object' THEN r.detail ELSE '{{}}'::jsonb END
               || jsonb_build_object('db_user', session_user)
      FROM recorded r
     CROSS JOIN LATERAL (SELECT greatest(r.claim_time, least(to_timestamp(r.started), now())) AS started) t
        ON CONFLICT (message_id, attempt, outcome, started_at) DO NOTHING;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_extend(me text, ids bigint[], lease double precision) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    -- A row another transaction has locked (this relay's own outcome writer, nearly always) is
    -- skipped, never waited for; it still counts as held, so it is not reported lost.
    RETURN QUERY
    WITH renewed AS (
        UPDATE {s}.outbox_message m SET locked_until = now() + lease * interval '1 second'
         WHERE m.id = ANY(ARRAY(
                SELECT c.id FROM {s}.outbox_message c
                 WHERE c.id = ANY(ids) AND c.locked_by = me AND c.status = 'running'
                   FOR UPDATE SKIP LOCKED))
    )
    SELECT m.id FROM {s}.outbox_message m WHERE m.id = ANY(ids) AND m.locked_by = me AND m.status = 'running';
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_release(me text, ids bigint[], claimed_attempts integer[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    released integer;
BEGIN
    UPDATE {s}.outbox_message m
       SET status = 'pending', locked_by = NULL, locked_until = NULL, attempts = m.attempts - 1,
           updated_at = now()
      FROM unnest(ids, claimed_attempts) AS c(id, attempt)
     WHERE m.id = c.id AND m.attempts = c.attempt AND m.locked_by = me AND m.status = 'running';
    GET DIAGNOSTICS released = ROW_COUNT;
    RETURN released;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_recover(me text, decisions jsonb)
RETURNS TABLE (message_id bigint, dead boolean, retry_in double precision, reason text)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
#variable_conflict use_column
DECLARE
    d record;
    msg {s}.outbox_message;
    last boolean;
    delay double precision;
    why text;
BEGIN
    FOR d IN SELECT * FROM jsonb_to_recordset(decisions)
                    AS x(id bigint, attempt int, dead boolean, delay float8, note text) LOOP
        SELECT * INTO msg FROM {s}.outbox_message o
         WHERE o.id = d.id AND o.attempts = d.attempt AND o.status = 'running' AND o.locked_until < now()
           FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- renewed, finished or being recovered meanwhile
        last := coalesce(d.dead, false) OR msg.attempts >= msg.max_attempts;
        delay := CASE WHEN last THEN 0 ELSE greatest(coalesce(d.delay, 0), 0) END;
        why := format('lease held by relay %s expired at %s', msg.locked_by,
                      to_char(msg.locked_until AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'));
        IF d.note IS NOT NULL THEN
            why := why || '; ' || d.note;
        END IF;
        UPDATE {s}.outbox_message o
           SET status = CASE WHEN last THEN 'dead' ELSE 'pending' END,
               available_at = CASE WHEN last THEN o.available_at
                                   ELSE now() + delay * interval '1 second' END,
               last_error = why, locked_by = NULL, locked_until = NULL, updated_at = now()
         WHERE o.id = msg.id;
        INSERT INTO {s}.outbox_attempt (message_id, attempt, outcome, started_at, finished_at, relay_id,
                                        error_type, error, detail)
        VALUES (msg.id, msg.attempts, 'lease_expired', msg.updated_at, now(), msg.locked_by,
                'LeaseExpired', why,
                jsonb_build_object('recovered_by', me, 'dead', last, 'retry_in', round(delay::numeric, 3),
                                   'db_user', session_user))
            ON CONFLICT (message_id, attempt, outcome, started_at) DO NOTHING;
        message_id := msg.id;
        dead := last;
        retry_in := delay;
        reason := why;
        RETURN NEXT;
    END LOOP;
END
$$
""",
    ]


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    schema_name = bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    s = bind.dialect.identifier_preparer.quote_identifier(schema_name)
    for statement in _sql(s):
        op.execute(statement)
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_message"},
    ).scalar_one()
    quoted_owner = bind.dialect.identifier_preparer.quote_identifier(owner)
    for function in RELAY_FUNCTIONS:
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quoted_owner}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    s = bind.dialect.identifier_preparer.quote_identifier(
        bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    )
    for function in RELAY_FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
