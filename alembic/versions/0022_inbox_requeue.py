"""Requeueing the inbox's dead letters: an operator's ``requeued``, then the consumer's ``handled``.

Revision ID: outbox_0022
Revises: outbox_0021
Create Date: 2026-12-18

``outbox_inbox_dead`` (``outbox_0020``) had a status (``dead``, ``requeued``,
``handled``) and the columns of a requeue, and nothing wrote them. A dead
letter now moves ``dead`` → ``requeued`` (an operator: ``requeued_at``, the
actor's label, the reason, and the new ``db_user``, the login), then
``requeued`` → ``handled`` (its consumer ran the handlers, ``handled_at``) or
``requeued`` → ``dead`` again (they failed again: the new error, one more
attempt, a new ``dead_at``). ``handled`` is final. The message's marker in
``outbox_inbox`` is never changed: it keeps saying ``dead``, and redeliveries
stay duplicates.

PostgreSQL does every one of those writes in a ``SECURITY DEFINER`` function
owned by the tables' owner, ``search_path`` pinned, EXECUTE revoked from
PUBLIC; the least-privilege block of docs/operations.md grants them:

- the operator's ``outbox_inbox_requeue(ids, actor, reason, strict)``: locks
  the named dead letters in id order and requeues those still ``dead``
  (``strict``: refuses the whole call if one is unknown or not dead), then
  wakes consumers with ``NOTIFY outbox_inbox`` (the payload is the consumer's
  name; polling finds them without it);
- the consumer's ``outbox_inbox_requeued(consumer, max_rows)``, which reads its
  requeued dead letters, oldest first (the consumer login still cannot read
  the others' payloads), ``outbox_inbox_take(consumer, dead_id)``, which
  marks one ``handled`` in the caller's transaction, the handlers' own, and
  answers false when it is not requeued any more or another transaction holds
  it (``FOR UPDATE SKIP LOCKED``: two consumers never both take it, and
  neither waits for the other's handlers), and ``outbox_inbox_dead_again``.

The trigger ``outbox_inbox_dead_kept`` (``outbox_0020``) keeps refusing DELETE
and TRUNCATE to everyone and UPDATE to all but the owner, and now refuses the
owner too an UPDATE that changes what the message was (id, consumer, message
id, type, source, payload, headers, ``sent_at``) or a status change other
than the three above. SQLite has no roles: ``outbox.ops`` and the inbox write
the same rows themselves, and the new trigger ``outbox_inbox_dead_changes``
refuses the same UPDATEs; ``outbox_inbox_dead_no_delete`` stays.

``db_user`` is a new nullable column: no table rewrite, no long lock. The
downgrade refuses while a dead letter is ``requeued`` (the older schema's
consumers would never take it up) or records a requeue's login (the record is
never destroyed).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0022"
down_revision = "outbox_0021"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"
#: The most requeued dead letters one read returns.
MAX_READ = 1000
#: The channel a requeue notifies; the payload is the consumer's name.
CHANNEL = "outbox_inbox"

OPERATOR_FUNCTIONS = ("outbox_inbox_requeue(bigint[], text, text, boolean)",)
CONSUMER_FUNCTIONS = (
    "outbox_inbox_requeued(text, integer)",
    "outbox_inbox_take(text, bigint)",
    "outbox_inbox_dead_again(text, bigint, text, text, boolean)",
)

#: What a dead letter's message is: no UPDATE may change it.
_FIXED = ("id", "consumer", "message_id", "event_type", "source", "payload", "headers", "sent_at")
#: The only status changes: an operator's requeue, then its consumer's outcome.
_MOVES = (("dead", "requeued"), ("requeued", "handled"), ("requeued", "dead"))


def _allowed(new: str, old: str, differs: str) -> str:
    """SQL that is true for an UPDATE of a dead letter the trigger lets through."""
    fixed = " AND ".join(f"NOT ({new}.{c} {differs} {old}.{c})" for c in _FIXED)
    moves = " OR ".join(f"({old}.status = '{a}' AND {new}.status = '{b}')" for a, b in _MOVES)
    return f"{fixed} AND ({moves})"


_SQLITE_TRIGGER = (
    "CREATE TRIGGER outbox_inbox_dead_changes BEFORE UPDATE ON outbox_inbox_dead"
    f" WHEN NOT ({_allowed('NEW', 'OLD', 'IS NOT')})"
    " BEGIN SELECT RAISE(ABORT, 'outbox_inbox_dead is a record: an UPDATE may only requeue a dead"
    " letter, then mark it handled or dead again, never change its message'); END"
)

_OWNER_IS_CURRENT_USER = (
    "pg_catalog.pg_get_userbyid(c.relowner) = current_user FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID"
)


def _kept(s: str, *, moves: bool) -> str:
    """``outbox_inbox_dead_kept`` for the quoted schema ``s``: ``outbox_0020``'s, or checking the change."""
    check = (
        f"""
        IF owner_acts AND NOT ({_allowed("NEW", "OLD", "IS DISTINCT FROM")}) THEN
            RAISE EXCEPTION 'outbox_inbox_dead is a record: an UPDATE may only requeue a dead letter,'
                ' then mark it handled or dead again, never change its message (dead letter %: % to %)',
                OLD.id, OLD.status, NEW.status
                USING ERRCODE = 'restrict_violation';
        END IF;"""
        if moves
        else ""
    )
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_inbox_dead_kept() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    owner_acts boolean;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        SELECT {_OWNER_IS_CURRENT_USER} INTO owner_acts;{check}
        IF owner_acts THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'outbox_inbox_dead is a record: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'dead letters change only through the outbox functions that requeue them';
END
$$
"""


def _text_checked(value: str, what: str, limit: int) -> str:
    """PL/pgSQL refusing a NULL, blank or too long text argument."""
    return f"""
    IF {value} IS NULL OR btrim({value}) = '' OR length({value}) > {limit} THEN
        RAISE EXCEPTION 'outbox inbox: {what} of 1 to {limit} characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;"""


def _functions(s: str) -> list[str]:
    """The operator's and the consumer's functions, with ``s`` the quoted schema of the tables."""
    return [
        f"""
CREATE FUNCTION {s}.outbox_inbox_requeue(ids bigint[], actor text, reason text, strict boolean)
RETURNS SETOF bigint LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    wanted bigint;
    letter {s}.outbox_inbox_dead;
BEGIN
    {_text_checked("actor", "an actor", 255)}
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'outbox inbox: a reason is required: it is what the record will say'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Locked in id order, as the outbox's own actions lock theirs: two requeues cannot deadlock.
    FOR wanted IN SELECT DISTINCT x FROM unnest(ids) AS x WHERE x IS NOT NULL ORDER BY 1 LOOP
        SELECT * INTO letter FROM {s}.outbox_inbox_dead d WHERE d.id = wanted FOR UPDATE;
        IF NOT FOUND THEN
            IF strict THEN
                RAISE EXCEPTION 'outbox inbox requeue: no dead letter with id %', wanted
                    USING ERRCODE = 'no_data_found';
            END IF;
            CONTINUE;
        END IF;
        IF letter.status <> 'dead' THEN
            IF strict THEN
                RAISE EXCEPTION 'outbox inbox requeue: dead letter % is %, not dead', wanted, letter.status
                    USING ERRCODE = 'object_not_in_prerequisite_state';
            END IF;
            CONTINUE;
        END IF;
        UPDATE {s}.outbox_inbox_dead d
           SET status = 'requeued', requeued_at = now(), actor = outbox_inbox_requeue.actor,
               reason = outbox_inbox_requeue.reason, db_user = session_user, handled_at = NULL
         WHERE d.id = wanted;
        PERFORM pg_notify('{CHANNEL}', letter.consumer);  -- delivered at commit, once per consumer
        RETURN NEXT wanted;
    END LOOP;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_inbox_requeued(consumer text, max_rows integer)
RETURNS TABLE (dead_id bigint, message_id text, event_type text, source text, payload text,
               headers text, sent_at timestamptz, attempts integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER {_PINNED} AS $$
BEGIN
    {_text_checked("consumer", "a consumer name", 255)}
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > {MAX_READ} THEN
        RAISE EXCEPTION 'outbox inbox: max_rows must be 1 to {MAX_READ}, got %', max_rows
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- As text: the caller decodes the documents itself, whatever its driver does with jsonb.
    RETURN QUERY
    SELECT d.id, d.message_id::text, d.event_type::text, d.source::text, d.payload::text,
           d.headers::text, d.sent_at, d.attempts
      FROM {s}.outbox_inbox_dead d
     WHERE d.consumer = outbox_inbox_requeued.consumer AND d.status = 'requeued'
     ORDER BY d.id
     LIMIT max_rows;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_inbox_take(consumer text, dead_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    -- Another transaction holding it is taking it (or putting it back): never wait for its handlers.
    PERFORM 1 FROM {s}.outbox_inbox_dead d
      WHERE d.id = dead_id AND d.consumer = outbox_inbox_take.consumer AND d.status = 'requeued'
        FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE {s}.outbox_inbox_dead d SET status = 'handled', handled_at = now() WHERE d.id = dead_id;
    RETURN true;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_inbox_dead_again(
    consumer text, dead_id bigint, error_type text, error text, counted boolean
) RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    {_text_checked("error_type", "an error type", 255)}
    IF error IS NULL OR counted IS NULL THEN
        RAISE EXCEPTION 'outbox inbox: an error text and whether a handler ran are required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Waits for a transaction taking it: if that one commits, it is handled and stays so.
    UPDATE {s}.outbox_inbox_dead d
       SET status = 'dead', error_type = outbox_inbox_dead_again.error_type,
           error = outbox_inbox_dead_again.error,
           attempts = d.attempts + CASE WHEN counted THEN 1 ELSE 0 END, dead_at = now()
     WHERE d.id = dead_id AND d.consumer = outbox_inbox_dead_again.consumer AND d.status = 'requeued';
    RETURN FOUND;
END
$$
""",
    ]


def _schema() -> str:
    bind = op.get_bind()
    name = str(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    return bind.dialect.identifier_preparer.quote_identifier(name)


def upgrade() -> None:
    op.add_column("outbox_inbox_dead", sa.Column("db_user", sa.String(255), nullable=True))
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        op.execute(_SQLITE_TRIGGER)
        return
    if bind.dialect.name != "postgresql":
        return
    s = _schema()
    # CREATE OR REPLACE of the same signature: the trigger function keeps its owner.
    op.execute(_kept(s, moves=True))
    for statement in _functions(s):
        op.execute(statement)
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_inbox_dead"},
    ).scalar_one()
    quoted_owner = bind.dialect.identifier_preparer.quote_identifier(owner)
    for function in (*OPERATOR_FUNCTIONS, *CONSUMER_FUNCTIONS):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quoted_owner}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")


def downgrade() -> None:
    bind = op.get_bind()
    waiting = bind.execute(
        sa.text("SELECT count(*) FROM outbox_inbox_dead WHERE status = 'requeued'")
    ).scalar_one()
    if waiting:
        raise RuntimeError(
            f"cannot downgrade below outbox_0022: {waiting} inbox dead letter(s) are requeued and not yet"
            " taken up by their consumer, which the older schema never would; let the consumers run"
            " process_requeued first"
        )
    logins = bind.execute(
        sa.text("SELECT count(*) FROM outbox_inbox_dead WHERE db_user IS NOT NULL")
    ).scalar_one()
    if logins:
        raise RuntimeError(
            f"cannot downgrade below outbox_0022: outbox_inbox_dead.db_user records the login of"
            f" {logins} requeue(s), a record that is never destroyed"
        )
    if bind.dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS outbox_inbox_dead_changes")
    elif bind.dialect.name == "postgresql":
        s = _schema()
        for function in (*OPERATOR_FUNCTIONS, *CONSUMER_FUNCTIONS):
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
        op.execute(_kept(s, moves=False))
    # Not a batch operation: on SQLite that rebuilds the table.
    op.execute("ALTER TABLE outbox_inbox_dead DROP COLUMN db_user")
