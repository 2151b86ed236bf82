"""Message expiry: ``outbox_message.expires_at``, the ``expired`` outcome, and ``outbox_complete`` for it.

Revision ID: outbox_0018
Revises: outbox_0017
Create Date: 2026-12-15

An order confirmation sent two days late is worse than none. ``emit(...,
expires_at=...)`` and ``ob.route(..., expires_after=...)`` give a message a
time after which it must not be handed to its handler; the relay then records
it as ``expired`` and the message ends ``discarded``. ``outbox_message`` gains
the nullable ``expires_at`` (NULL: never expires; existing rows keep NULL) and
the check constraint on ``outbox_attempt.outcome`` gains ``expired``.

Where the relay learns of it. The relay claims through ``outbox_claim``, whose
result columns are its type: adding ``expires_at`` to them needs ``DROP
FUNCTION`` and ``CREATE``, which loses every ``GRANT EXECUTE`` made since
(the relay's login would be refused at its next start), and a relay still
running while the migration commits has its claim prepared with the old
result type (psycopg prepares a statement it runs often), which PostgreSQL
then refuses ("cached plan must not change result type") on every claim until
it reconnects. So ``outbox_claim`` is left as it is, and the relay's claim
call reads the claimed rows' ``expires_at`` beside it, in the same statement:
the function's rows joined to ``outbox_message`` by id (the relay's login may
read that table), with ``expires_at <= now()`` judged there, by the database
clock of the claim. The relay hands a row so judged to no handler and records
it ``expired``; ``now()`` at that later write is not earlier, so the database
agrees. A message committed in the instant between the statement's snapshot
and the claim's own is claimed without its expiry read; it is just written,
not yet expired, and is delivered.

``outbox_complete`` keeps its signature (so its owner and grants stay) and is
replaced: the relay may now record outcome ``expired`` with status
``discarded`` (and ``discarded`` only with ``expired``), and only for a
message whose ``expires_at`` is set and not after the database's ``now()``;
otherwise the call is refused like any outcome the relay may not record. A
relay login can therefore not use ``expired`` to drop a message that is still
due. ``requeue`` and ``resend`` copies do not carry ``expires_at``: an
operator's copy is a new decision to deliver.

SQLite cannot change a check constraint in place: ``outbox_attempt`` is
rebuilt with its rows, indexes and ``AUTOINCREMENT`` counter, and its
append-only triggers are created again, as ``outbox_0017`` did. SQLite has no
roles: the relay writes the same rows itself there.

The downgrade refuses while ``expired`` history rows exist (history is never
rewritten, and the old constraint would reject them); otherwise it restores
``outbox_0015``'s ``outbox_complete`` and drops the column.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0018"
down_revision = "outbox_0017"
branch_labels = None
depends_on = None

_BEFORE = (
    "delivered",
    "retry",
    "failed",
    "dead",
    "timeout",
    "lease_expired",
    "requeued",
    "discarded",
    "retried_now",
    "resent",
)
_AFTER = (*_BEFORE, "expired")
_NAME = "ck_outbox_attempt_outcome"
_PINNED = "SET search_path = pg_catalog, pg_temp"

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_TS = sa.DateTime(timezone=True)

# outbox_0001, outbox_0007 and outbox_0008: SQLite drops a table's triggers with the table.
_SQLITE_TRIGGERS = (
    "CREATE TRIGGER outbox_attempt_no_update BEFORE UPDATE ON outbox_attempt"
    " BEGIN SELECT RAISE(ABORT, 'outbox_attempt is append-only: UPDATE is not allowed'); END",
    "CREATE TRIGGER outbox_attempt_no_delete BEFORE DELETE ON outbox_attempt"
    " WHEN outbox_purge_in_progress() IS NOT 1"
    " BEGIN SELECT RAISE(ABORT,"
    " 'outbox_attempt is append-only: DELETE is allowed only through outbox purge'); END",
    "CREATE TRIGGER outbox_attempt_no_replace BEFORE INSERT ON outbox_attempt"
    " WHEN EXISTS (SELECT 1 FROM outbox_attempt WHERE id = NEW.id)"
    " BEGIN SELECT RAISE(ABORT, 'outbox_attempt is append-only:"
    " REPLACE or UPSERT may not rewrite an existing row'); END",
    "CREATE TRIGGER outbox_attempt_once_kept BEFORE INSERT ON outbox_attempt"
    " WHEN EXISTS (SELECT 1 FROM outbox_attempt WHERE message_id = NEW.message_id"
    " AND attempt = NEW.attempt AND outcome = NEW.outcome AND started_at = NEW.started_at)"
    " BEGIN SELECT RAISE(IGNORE); END",
)
_SQLITE_TRIGGER_NAMES = (
    "outbox_attempt_no_update",
    "outbox_attempt_no_delete",
    "outbox_attempt_no_replace",
    "outbox_attempt_once_kept",
)


def _one_of(values: tuple[str, ...]) -> str:
    return f"outcome IN ({', '.join(repr(v) for v in values)})"


def _sqlite_table(outcomes: tuple[str, ...]) -> sa.Table:
    """outbox_attempt as it stands at this revision, with the given outcomes allowed."""
    return sa.Table(
        "outbox_attempt",
        sa.MetaData(),
        sa.Column("id", _ID, primary_key=True),
        sa.Column("message_id", _ID, nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("finished_at", _TS),
        sa.Column("duration_ms", sa.Integer()),
        sa.Column("relay_id", sa.String(255)),
        sa.Column("error_type", sa.String(255)),
        sa.Column("error", sa.Text()),
        sa.Column("detail", _JSON),
        sa.Column("actor", sa.String(255)),
        sa.Column("reason", sa.Text()),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_attempt"),
        sa.CheckConstraint(_one_of(outcomes), name=_NAME),
        sa.Index("ux_outbox_attempt_once", "message_id", "attempt", "outcome", "started_at", unique=True),
        sa.Index("ix_outbox_attempt_started_at", "started_at"),
        sqlite_autoincrement=True,
    )


def _allow(outcomes: tuple[str, ...]) -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        # The counter AUTOINCREMENT keeps, so ids of purged rows are never handed out again.
        counter = bind.execute(
            sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'outbox_attempt'")
        ).scalar_one_or_none()
        for trigger in _SQLITE_TRIGGER_NAMES:
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
        with op.batch_alter_table("outbox_attempt", recreate="always", copy_from=_sqlite_table(outcomes)):
            pass
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)
        if counter is not None:
            op.execute(
                sa.text(
                    "UPDATE sqlite_sequence SET seq = max(seq, :seq) WHERE name = 'outbox_attempt'"
                ).bindparams(seq=counter)
            )
        return
    op.drop_constraint(op.f(_NAME), "outbox_attempt", type_="check")
    op.create_check_constraint(op.f(_NAME), "outbox_attempt", _one_of(outcomes))


def _complete(s: str, *, expiry: bool) -> str:
    """``outbox_complete`` for the quoted schema ``s``: ``outbox_0015``'s, or with expiry (``expiry``)."""
    statuses = "'delivered', 'pending', 'dead'" + (", 'discarded'" if expiry else "")
    outcomes = "'delivered', 'retry', 'failed', 'dead', 'timeout'" + (", 'expired'" if expiry else "")
    pairs = "\n            OR (o.status = 'discarded') <> (o.outcome = 'expired')" if expiry else ""
    expired_check = (
        f"""
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
        if expiry
        else ""
    )
    declare = "\nDECLARE\n    early_id bigint;\n    early_at timestamptz;" if expiry else ""
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_complete(me text, batch jsonb) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $${declare}
BEGIN
    IF EXISTS (
        SELECT 1 FROM jsonb_to_recordset(batch) AS o(status text, outcome text, refund int)
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
"""


def _schema() -> str:
    bind = op.get_bind()
    return str(
        bind.dialect.identifier_preparer.quote_identifier(
            bind.execute(sa.text("SELECT current_schema()")).scalar_one()
        )
    )


def upgrade() -> None:
    # ADD COLUMN, not a batch operation: on SQLite that would rebuild outbox_message.
    op.add_column("outbox_message", sa.Column("expires_at", _TS, nullable=True))
    _allow(_AFTER)
    if op.get_bind().dialect.name != "postgresql":
        return
    # CREATE OR REPLACE of the same signature: the function keeps its owner and its grants.
    op.execute(_complete(_schema(), expiry=True))


def downgrade() -> None:
    recorded = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM outbox_attempt WHERE outcome = 'expired'"))
        .scalar_one()
    )
    if recorded:
        raise RuntimeError(
            f"cannot downgrade below outbox_0018: {recorded} history row(s) record an expiry,"
            " and history is never rewritten"
        )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_complete(_schema(), expiry=False))
    _allow(_BEFORE)
    # Not a batch operation: on SQLite that rebuilds the table.
    op.execute("ALTER TABLE outbox_message DROP COLUMN expires_at")
