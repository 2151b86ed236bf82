"""``outbox resend``: the ``resent`` history outcome, and ``outbox_resend`` on PostgreSQL.

Revision ID: outbox_0017
Revises: outbox_0016
Create Date: 2026-12-14

A partner that lost a webhook it had acknowledged needs the message again.
``outbox resend`` gives a delivered (or discarded) message a new pending copy,
as requeue does for a dead one: same event id, payload and route,
``requeued_from`` naming the original, and a history row on the original
saying who resent it, why, and as which id. None of the existing outcomes says
that (``requeued`` is for dead and discarded messages, at most once), so the
check constraint on ``outbox_attempt.outcome`` gains ``resent``.

PostgreSQL does it in a ``SECURITY DEFINER`` function written like the actions
of ``outbox_0014``, owned by the tables' owner, ``search_path`` pinned, EXECUTE
revoked from PUBLIC: ``outbox_resend(ids, copy_keys, actor, reason, strict)``
locks each message, checks under the lock that it is still delivered or
discarded, inserts the copy and writes the ``resent`` row with the database
clock and the login (``detail.db_user``). A message may be resent any number
of times, so the copy's key suffix names the copy itself: ``~resend:<new id>``,
unique by construction however often the original is resent. The function
takes the id from the table's identity sequence (named in the function as the
migration finds it) before inserting, so the key is right in the one insert.
``copy_keys`` carries, per message, the original's ``outbox.ops.root_key``
(NULL for a message without a key): the copy's key starts with it instead of
the original's key when that key and the suffix would not fit the column
together, as requeue's keys do.

PostgreSQL checks the new constraint against every history row once, holding
a lock that makes the relay's history writes wait meanwhile (a sequential read
of the table: about a second per few million rows). SQLite cannot change a
check constraint in place: the table is rebuilt with its rows, indexes and
``AUTOINCREMENT`` counter, and its append-only triggers are created again, as
``outbox_0009`` did. SQLite has no roles: ``outbox.ops`` writes the rows itself
there.

The downgrade refuses while ``resent`` rows exist: history is never rewritten,
and the old constraint would reject them. The copies stay, ordinary messages.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0017"
down_revision = "outbox_0016"
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
)
_AFTER = (*_BEFORE, "resent")
_NAME = "ck_outbox_attempt_outcome"
_PINNED = "SET search_path = pg_catalog, pg_temp"
FUNCTION = "outbox_resend(bigint[], text[], text, text, boolean)"

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


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _resend_function(s: str, sequence: str) -> str:
    """``outbox_resend`` for the tables of the quoted schema ``s``; ``sequence``: ``outbox_message.id``'s."""
    changed = """RAISE EXCEPTION 'outbox %: message % changed meanwhile; try again', verb, ids[i]
                    USING ERRCODE = 'object_not_in_prerequisite_state'"""
    return f"""
CREATE FUNCTION {s}.outbox_resend(ids bigint[], copy_keys text[], actor text, reason text, strict boolean)
RETURNS TABLE (old_id bigint, new_id bigint)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    verb text := 'resend';
    old {s}.outbox_message;
    copy_id bigint;
    suffix text;
    copy_key text;
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    IF cardinality(ids) IS DISTINCT FROM cardinality(copy_keys) THEN
        RAISE EXCEPTION 'outbox resend: one root key (or NULL) per message id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        -- An id given twice is resent once: both copies' history rows would carry this
        -- transaction's clock, and the history keeps one row per message, attempt, outcome and time.
        IF ids[i] = ANY (ids[1:i - 1]) THEN
            CONTINUE;
        END IF;
        SELECT * INTO old FROM {s}.outbox_message o WHERE o.id = ids[i] FOR UPDATE;
        -- Finished and delivered, or dropped: never a message still on its way, nor a dead one
        -- (that is requeue's). Unlike requeue, a message may be resent again and again.
        IF NOT FOUND OR old.status NOT IN ('delivered', 'discarded') THEN
            IF strict THEN
                {changed};
            END IF;
            CONTINUE;
        END IF;
        IF (old.idempotency_key IS NULL) <> (copy_keys[i] IS NULL) THEN
            RAISE EXCEPTION 'outbox resend: message % needs its root key, or NULL when it has no key', old.id
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- The suffix names the copy itself, so every resend of a message has a key of its own.
        copy_id := nextval({_literal(sequence)}::regclass);
        suffix := '~resend:' || copy_id;
        IF length(old.idempotency_key) + length(suffix) <= 255 THEN
            copy_key := old.idempotency_key || suffix;
        ELSE
            copy_key := copy_keys[i] || suffix;
        END IF;
        IF length(copy_key) > 255 THEN
            RAISE EXCEPTION 'outbox resend: the root key given for message % leaves no room for %',
                            old.id, suffix
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        INSERT INTO {s}.outbox_message
            (id, event_id, event_type, handler, queue, priority, payload, headers, aggregate_type,
             aggregate_id, idempotency_key, group_key, status, attempts, max_attempts, available_at,
             created_at, updated_at, requeued_from)
        VALUES (copy_id, old.event_id, old.event_type, old.handler, old.queue, old.priority, old.payload,
                old.headers, old.aggregate_type, old.aggregate_id, copy_key, old.group_key,
                'pending', 0, old.max_attempts, now(), now(), now(), old.id);
        PERFORM {s}.outbox_action_recorded(old.id, old.attempts, old.status, 'resent', actor, reason,
                                           jsonb_build_object('new_id', copy_id));
        old_id := old.id;
        new_id := copy_id;
        RETURN NEXT;
    END LOOP;
END
$$
"""


def _schema() -> tuple[str, str]:
    """The current schema's quoted name, and that of the role owning ``outbox_message`` in it."""
    bind = op.get_bind()
    quote = bind.dialect.identifier_preparer.quote_identifier
    s = quote(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_message"},
    ).scalar_one()
    return s, quote(owner)


def upgrade() -> None:
    _allow(_AFTER)
    if op.get_bind().dialect.name != "postgresql":
        return
    s, owner = _schema()
    # The identity sequence of outbox_message.id, schema-qualified and quoted as nextval() reads it.
    sequence = (
        op.get_bind()
        .execute(sa.text("SELECT pg_get_serial_sequence(:table, 'id')"), {"table": f"{s}.outbox_message"})
        .scalar_one()
    )
    op.execute(_resend_function(s, sequence))
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    op.execute(f"ALTER FUNCTION {s}.{FUNCTION} OWNER TO {owner}")
    op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{FUNCTION} FROM PUBLIC")


def downgrade() -> None:
    recorded = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM outbox_attempt WHERE outcome = 'resent'"))
        .scalar_one()
    )
    if recorded:
        raise RuntimeError(
            f"cannot downgrade below outbox_0017: {recorded} history row(s) record a resend,"
            " and history is never rewritten"
        )
    if op.get_bind().dialect.name == "postgresql":
        s, _ = _schema()
        op.execute(f"DROP FUNCTION IF EXISTS {s}.{FUNCTION}")
    _allow(_BEFORE)
