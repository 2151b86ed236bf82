"""Parked messages: ``outbox_message.parked_on``, ``outbox_complete`` writing it, ``outbox_unpark``.

Revision ID: outbox_0021
Revises: outbox_0020
Create Date: 2026-12-16

A message deferred because its destination is unavailable (a broker away, a
webhook receiver behind an open circuit breaker) waited a fixed time: up to
30 seconds after the destination came back, however quickly the relay could
have known. Such a deferral now names the destination
(``RetryLater(until_recovered=...)``) and the relay records it on the message,
in the nullable ``outbox_message.parked_on``, with a long safety delay. When
the relay learns the destination is back (a publisher reconnects, a trial
request succeeds, an operator resets the breaker) it calls
``outbox_unpark(destination)``, which makes every pending message parked on it
due now, clears the column and wakes the relays (NOTIFY), so the backlog goes
out at once; should that call never come, the safety delay alone brings each
message back, later.

``outbox_complete`` keeps its signature, owner and grants and is replaced: a
batch entry may carry ``parked_on``, written on the message (NULL for every
outcome without one, so an ordinary outcome leaves the column as the claim
left it, NULL, and the write stays a heap-only update where it was one). The
relay may park a message only while it stays ``pending``, uncounted (the
refund), on a destination of 1 to 1000 characters; anything else is refused
like any outcome the relay may not record. ``outbox_claim`` is left as it is
(``outbox_0018`` says why): a claimed message keeps its ``parked_on`` until its
outcome replaces it.

``outbox_unpark`` is ``SECURITY DEFINER``, owned by the tables' owner, with
``search_path`` pinned and EXECUTE revoked from PUBLIC; the least-privilege
block in docs/operations.md grants it to the relay and the operator (whose
``outbox breaker reset`` and ``retry-now`` release what a cleared breaker held
back). It locks the rows it releases in id order and skips none: a message a
claim holds is running, not parked, and is left alone. It writes no history:
each parking has its history row already, and the release only brings the
next attempt forward.

The partial index ``ix_outbox_message_parked_on`` (``WHERE parked_on IS NOT
NULL``) holds only parked messages: the release and ``outbox stats`` read it,
and no other write touches it. Building it reads the whole table once while
blocking writes (emits); on a big, busy table create it beforehand without
that lock, and the migration skips it::

    CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_outbox_message_parked_on
        ON outbox_message (parked_on) WHERE parked_on IS NOT NULL;

SQLite has no roles: the relay and ``outbox.ops`` write the same rows
themselves there (``outbox._parking``). The downgrade restores
``outbox_0018``'s ``outbox_complete`` and drops the function, the index and
the column; messages parked at that moment keep their safety delay.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0021"
down_revision = "outbox_0020"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"
#: The longest destination (``outbox_breaker.destination``'s limit in its functions).
DESTINATION_LIMIT = 1000
_PARKED = sa.text("parked_on IS NOT NULL")

FUNCTIONS = ("outbox_unpark(text)",)


def _complete(s: str, *, parking: bool) -> str:
    """``outbox_complete`` for the quoted schema ``s``: ``outbox_0018``'s, or writing ``parked_on``."""
    statuses = "'delivered', 'pending', 'dead', 'discarded'"
    outcomes = "'delivered', 'retry', 'failed', 'dead', 'timeout', 'expired'"
    pairs = "\n            OR (o.status = 'discarded') <> (o.outcome = 'expired')"
    checked = "status text, outcome text, refund int" + (", parked_on text" if parking else "")
    if parking:
        # Parked only while pending, never counted, on a destination outbox_unpark can be given.
        pairs += (
            "\n            OR (o.parked_on IS NOT NULL AND (o.status <> 'pending'"
            "\n                OR o.refund IS DISTINCT FROM 1 OR btrim(o.parked_on) = ''"
            f"\n                OR length(o.parked_on) > {DESTINATION_LIMIT}))"
        )
    columns = "detail jsonb" + (", parked_on text" if parking else "")
    parked = (
        "\n               parked_on = CASE WHEN o.status = 'pending' THEN o.parked_on END," if parking else ""
    )
    expired_check = f"""
    -- Expired is the database's word, not the relay's: a message that is still due stays due.
    -- (Looked for only in a batch that has one, by containment: no second parse of every batch.)
    IF batch @> '[{{"outcome": "expired"}}]'::jsonb THEN
    SELECT o.id, m.expires_at INTO early_id, early_at
      FROM jsonb_to_recordset(batch) AS o(id bigint, outcome text)
      LEFT JOIN {s}.outbox_message m ON m.id = o.id
     WHERE o.outcome = 'expired' AND (m.expires_at IS NULL OR m.expires_at > now())
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox complete: message % has not expired (expires_at %, database time %)',
            early_id, coalesce(early_at::text, 'none'), now()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    END IF;"""
    declare = "\nDECLARE\n    early_id bigint;\n    early_at timestamptz;"
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_complete(me text, batch jsonb) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $${declare}
BEGIN
    IF EXISTS (
        SELECT 1 FROM jsonb_to_recordset(batch) AS o({checked})
         WHERE o.status IS NULL OR o.status NOT IN ({statuses})
            OR o.outcome IS NULL OR o.outcome NOT IN ({outcomes})
            OR (o.status = 'delivered') <> (o.outcome = 'delivered'){pairs}
            OR coalesce(o.refund, 0) NOT IN (0, 1) OR (o.refund = 1 AND o.status <> 'pending')
    ) THEN
        RAISE EXCEPTION 'outbox complete: an outcome the relay cannot record (status %, outcome %)',
            (SELECT string_agg(DISTINCT coalesce(o.status, 'null'), ', ')
               FROM jsonb_to_recordset(batch) AS o(status text)),
            (SELECT string_agg(DISTINCT coalesce(o.outcome, 'null'), ', ')
               FROM jsonb_to_recordset(batch) AS o(outcome text))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;{expired_check}
    WITH outcome AS (
        SELECT * FROM jsonb_to_recordset(batch)
            AS o(id bigint, attempt int, status text, outcome text, error text, error_type text,
                 delay float8, refund int, started float8, finished float8, duration_ms int,
                 {columns})
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
               attempts = m.attempts - coalesce(o.refund, 0),{parked}
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
"""


def _unpark(s: str, schema_name: str) -> str:
    """``outbox_unpark`` for the quoted schema ``s``; ``schema_name`` is what NOTIFY sends (outbox_0001)."""
    channel = "'" + schema_name.replace("'", "''") + "'"
    return f"""
CREATE FUNCTION {s}.outbox_unpark(destination text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    released integer;
BEGIN
    IF destination IS NULL OR btrim(destination) = '' OR length(destination) > {DESTINATION_LIMIT} THEN
        RAISE EXCEPTION 'outbox unpark: a destination of 1 to {DESTINATION_LIMIT} characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Locked in id order, as the operator's actions lock theirs: two releases cannot deadlock.
    UPDATE {s}.outbox_message m
       SET available_at = least(m.available_at, now()), parked_on = NULL, updated_at = now()
     WHERE m.id = ANY(ARRAY(
            SELECT p.id FROM {s}.outbox_message p
             WHERE p.parked_on = destination AND p.status = 'pending'
             ORDER BY p.id
               FOR UPDATE))
       AND m.parked_on = destination AND m.status = 'pending';
    GET DIAGNOSTICS released = ROW_COUNT;
    IF released > 0 THEN  -- the NOTIFY trigger fires on INSERT only: wake the relays here
        PERFORM pg_notify('outbox', {channel});
    END IF;
    RETURN released;
END
$$
"""


def _schema() -> tuple[str, str]:
    """The schema the outbox tables live in: quoted, and as NOTIFY names it."""
    bind = op.get_bind()
    name = str(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    return bind.dialect.identifier_preparer.quote_identifier(name), name


def upgrade() -> None:
    # ADD COLUMN, not a batch operation: on SQLite that would rebuild outbox_message.
    op.add_column("outbox_message", sa.Column("parked_on", sa.Text(), nullable=True))
    op.create_index(
        "ix_outbox_message_parked_on",
        "outbox_message",
        ["parked_on"],
        postgresql_where=_PARKED,
        sqlite_where=_PARKED,
        if_not_exists=True,
    )
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    s, name = _schema()
    # CREATE OR REPLACE of the same signature: the function keeps its owner and its grants.
    op.execute(_complete(s, parking=True))
    op.execute(_unpark(s, name))
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_message"},
    ).scalar_one()
    quoted_owner = bind.dialect.identifier_preparer.quote_identifier(owner)
    for function in FUNCTIONS:
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quoted_owner}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        s, _ = _schema()
        for function in FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
        op.execute(_complete(s, parking=False))
    op.drop_index("ix_outbox_message_parked_on", table_name="outbox_message", if_exists=True)
    # Not a batch operation: on SQLite that rebuilds the table.
    op.execute("ALTER TABLE outbox_message DROP COLUMN parked_on")
