"""The audit trail holds against an operator: purges run inside the database, as the table owner.

Revision ID: outbox_0007
Revises: outbox_0006
Create Date: 2026-12-03

Until now the purge ran as the operator: it needed DELETE on ``outbox_attempt``
and INSERT/UPDATE on ``outbox_retention_run``, so it could write its own
record (a cutoff a century ahead, then put back) and its own counts. The
append-only trigger also looked ``outbox_retention_run`` up through the
caller's ``search_path``, where a temporary table of that name could answer.

PostgreSQL now:

- purges through three ``SECURITY DEFINER`` functions owned by the tables'
  owner: ``outbox_purge_start`` writes the run (cutoffs from the server's
  clock, ``session_user``, a history cutoff at least one day old),
  ``outbox_purge_step`` deletes one batch and adds its count in the same
  transaction, ``outbox_purge_finish`` closes the run. Each refuses a run that
  is unknown, finished or started by another login. EXECUTE is revoked from
  PUBLIC: the least-privilege block grants it to the operator;
- lets a history DELETE through only when the current role owns
  ``outbox_attempt`` (inside those functions it does; an operator never does),
  so a role that still holds DELETE from an older grant gets the append-only
  error and nothing else;
- lets only the owner write ``outbox_retention_run`` (again: those functions);
- pins ``search_path`` of every outbox function to ``pg_catalog, pg_temp`` and
  names each table with the schema the migration runs in.

By default a purge keeps the history of unresolved messages (pending, running,
or dead with nobody having requeued them); a run that was told otherwise says
so in ``history_of_unresolved``. Runs recorded before this revision deleted
history regardless of status, and are marked that way.

SQLite: ``INSERT OR REPLACE`` (and ``REPLACE INTO``, and an UPSERT on ``id``)
could rewrite a history row, because REPLACE deletes the old row without firing
DELETE triggers; an insert that names an existing id is now refused.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0007"
down_revision = "outbox_0006"
branch_labels = None
depends_on = None

#: The youngest history a purge may delete is this old (docs/operations.md, Retention).
MIN_HISTORY_AGE = "1 day"
#: Rows one step may delete at most: a purge stays a series of short transactions.
MAX_BATCH = 10000

_PINNED = "SET search_path = pg_catalog, pg_temp"

_SQLITE_NO_REWRITE = (
    "CREATE TRIGGER outbox_attempt_no_replace BEFORE INSERT ON outbox_attempt"
    " WHEN EXISTS (SELECT 1 FROM outbox_attempt WHERE id = NEW.id)"
    " BEGIN SELECT RAISE(ABORT, 'outbox_attempt is append-only:"
    " REPLACE or UPSERT may not rewrite an existing row'); END"
)

_PURGE_FUNCTIONS = (
    "outbox_purge_start(text, interval, interval, boolean)",
    "outbox_purge_step(bigint, integer)",
    "outbox_purge_finish(bigint)",
)


def _pg_upgrade_sql(s: str) -> list[str]:
    """Every statement, with ``s`` the quoted schema the outbox tables live in."""
    owner_is_current_user = (
        "pg_catalog.pg_get_userbyid(c.relowner) = current_user"
        " FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID"
    )
    # A dead message counts as resolved once someone requeued it (a copy points at it, or its
    # history says so): the copy, not the original, is then what to watch.
    unresolved = f"""
        m.status IN ('pending', 'running')
        OR (m.status = 'dead'
            AND NOT EXISTS (SELECT 1 FROM {s}.outbox_message c WHERE c.requeued_from = m.id)
            AND NOT EXISTS (SELECT 1 FROM {s}.outbox_attempt r
                             WHERE r.message_id = m.id AND r.outcome = 'requeued'))
    """
    return [
        f"""
CREATE OR REPLACE FUNCTION {s}.outbox_notify() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
BEGIN
    PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$
""",
        # Non-owners are refused before any table is read: no SELECT needed, nothing to shadow.
        f"""
CREATE OR REPLACE FUNCTION {s}.outbox_attempt_append_only() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    purge text := current_setting('outbox.retention', true);
    owner_acts boolean;
BEGIN
    SELECT {owner_is_current_user} INTO owner_acts;
    IF TG_OP = 'DELETE' AND owner_acts AND purge ~ '^[0-9]{{1,18}}$' AND EXISTS (
        SELECT 1 FROM {s}.outbox_retention_run r
         WHERE r.id = purge::bigint AND r.finished_at IS NULL
           AND r.history_before IS NOT NULL AND OLD.started_at < r.history_before
    ) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'outbox_attempt is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'history rows leave only through the outbox retention command (outbox purge)';
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_retention_run_written_by_purge() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    owner_acts boolean;
BEGIN
    SELECT {owner_is_current_user} INTO owner_acts;
    IF owner_acts THEN
        RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    END IF;
    RAISE EXCEPTION 'outbox_retention_run is written only by the outbox purge functions: '
                    '% is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege',
              HINT = 'run outbox purge (it calls outbox_purge_start, outbox_purge_step, outbox_purge_finish)';
END
$$
""",
        f"CREATE TRIGGER outbox_retention_run_written_by_purge BEFORE INSERT OR UPDATE OR DELETE"
        f" ON {s}.outbox_retention_run FOR EACH ROW"
        f" EXECUTE FUNCTION {s}.outbox_retention_run_written_by_purge()",
        f"CREATE TRIGGER outbox_retention_run_no_truncate BEFORE TRUNCATE"
        f" ON {s}.outbox_retention_run FOR EACH STATEMENT"
        f" EXECUTE FUNCTION {s}.outbox_retention_run_written_by_purge()",
        f"""
CREATE FUNCTION {s}.outbox_purge_start(
    actor text,
    delivered_older_than interval,
    history_older_than interval DEFAULT NULL,
    history_of_unresolved boolean DEFAULT false
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    run_id bigint;
BEGIN
    IF actor IS NULL OR btrim(actor) = '' OR length(actor) > 255 THEN
        RAISE EXCEPTION 'outbox purge: an actor of 1 to 255 characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF delivered_older_than IS NULL OR delivered_older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox purge: delivered_older_than must be zero or more, got %', delivered_older_than
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF history_older_than < interval '{MIN_HISTORY_AGE}' THEN
        RAISE EXCEPTION 'outbox purge: history_older_than must be at least {MIN_HISTORY_AGE}, got %',
                        history_older_than
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'history younger than {MIN_HISTORY_AGE} is never purged';
    END IF;
    IF history_of_unresolved IS NULL THEN
        RAISE EXCEPTION 'outbox purge: history_of_unresolved must be true or false'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO {s}.outbox_retention_run
        (started_at, actor, db_user, delivered_before, history_before, history_of_unresolved)
    VALUES (now(), actor, session_user, now() - delivered_older_than, now() - history_older_than,
            history_older_than IS NOT NULL AND history_of_unresolved)
    RETURNING id INTO run_id;
    RETURN run_id;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_purge_open_run(run_id bigint) RETURNS {s}.outbox_retention_run
LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    run {s}.outbox_retention_run;
BEGIN
    SELECT * INTO run FROM {s}.outbox_retention_run r WHERE r.id = run_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox purge: no purge run %', run_id
            USING ERRCODE = 'invalid_parameter_value', HINT = 'start one with outbox_purge_start';
    END IF;
    IF run.finished_at IS NOT NULL THEN
        RAISE EXCEPTION 'outbox purge: purge run % is finished', run_id
            USING ERRCODE = 'invalid_parameter_value', HINT = 'start a new one with outbox_purge_start';
    END IF;
    IF run.db_user IS DISTINCT FROM session_user THEN
        RAISE EXCEPTION 'outbox purge: purge run % belongs to another login', run_id
            USING ERRCODE = 'insufficient_privilege', HINT = 'start your own with outbox_purge_start';
    END IF;
    RETURN run;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_purge_step(run_id bigint, batch_size integer)
RETURNS TABLE (messages_deleted integer, attempts_deleted integer)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    run {s}.outbox_retention_run;
    deleted integer;
BEGIN
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > {MAX_BATCH} THEN
        RAISE EXCEPTION 'outbox purge: batch_size must be 1 to {MAX_BATCH}, got %', batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    run := {s}.outbox_purge_open_run(run_id);

    -- Finished messages first; an original that a requeued copy points at stays while the copy exists.
    DELETE FROM {s}.outbox_message d
     WHERE d.id IN (
        SELECT m.id FROM {s}.outbox_message m
         WHERE m.status IN ('delivered', 'discarded') AND m.updated_at < run.delivered_before
           AND NOT EXISTS (SELECT 1 FROM {s}.outbox_message c WHERE c.requeued_from = m.id)
         ORDER BY m.id LIMIT batch_size)
       AND d.status IN ('delivered', 'discarded');
    GET DIAGNOSTICS deleted = ROW_COUNT;
    IF deleted > 0 THEN
        UPDATE {s}.outbox_retention_run r SET messages_deleted = r.messages_deleted + deleted
         WHERE r.id = run.id;
        RETURN QUERY SELECT deleted, 0;
        RETURN;
    END IF;

    IF run.history_before IS NOT NULL THEN
        PERFORM set_config('outbox.retention', run.id::text, true);
        DELETE FROM {s}.outbox_attempt d
         WHERE d.id IN (
            SELECT h.id FROM {s}.outbox_attempt h
             WHERE h.started_at < run.history_before
               AND (run.history_of_unresolved OR NOT EXISTS (
                    SELECT 1 FROM {s}.outbox_message m WHERE m.id = h.message_id AND ({unresolved})))
             ORDER BY h.id LIMIT batch_size);
        GET DIAGNOSTICS deleted = ROW_COUNT;
        PERFORM set_config('outbox.retention', '', true);
        IF deleted > 0 THEN
            UPDATE {s}.outbox_retention_run r SET attempts_deleted = r.attempts_deleted + deleted
             WHERE r.id = run.id;
            RETURN QUERY SELECT 0, deleted;
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT 0, 0;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_purge_finish(run_id bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    run {s}.outbox_retention_run;
BEGIN
    run := {s}.outbox_purge_open_run(run_id);
    UPDATE {s}.outbox_retention_run r SET finished_at = clock_timestamp() WHERE r.id = run.id;
END
$$
""",
        f"REVOKE EXECUTE ON FUNCTION {s}.outbox_purge_open_run(bigint) FROM PUBLIC",
        *(f"REVOKE EXECUTE ON FUNCTION {s}.{f} FROM PUBLIC" for f in _PURGE_FUNCTIONS),
    ]


# The bodies of outbox_0006 (and outbox_0001 for NOTIFY), for the downgrade.
_PG_0006_APPEND_ONLY = """
CREATE OR REPLACE FUNCTION outbox_attempt_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    purge text := current_setting('outbox.retention', true);
BEGIN
    IF TG_OP = 'DELETE' AND purge ~ '^[0-9]{1,18}$' AND EXISTS (
        SELECT 1 FROM outbox_retention_run r
         WHERE r.id = purge::bigint AND r.finished_at IS NULL
           AND r.history_before IS NOT NULL AND OLD.started_at < r.history_before
    ) THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'outbox_attempt is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'history rows leave only through the outbox retention command (outbox purge)';
END
$$
"""

_PG_0001_NOTIFY = """
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$
"""


def _schema() -> str:
    """The schema this migration runs in, where the outbox tables are, quoted for SQL."""
    bind = op.get_bind()
    name = bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    return bind.dialect.identifier_preparer.quote_identifier(name)


def upgrade() -> None:
    op.add_column("outbox_retention_run", sa.Column("db_user", sa.String(255)))
    op.add_column(
        "outbox_retention_run",
        sa.Column("history_of_unresolved", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    # Purges before this revision deleted history whatever the state of its message.
    op.execute("UPDATE outbox_retention_run SET history_of_unresolved = (history_before IS NOT NULL)")
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        op.execute(_SQLITE_NO_REWRITE)
        return
    if bind.dialect.name != "postgresql":
        return
    s = _schema()
    for statement in _pg_upgrade_sql(s):
        op.execute(statement)
    # SECURITY DEFINER runs as the function's owner, and the triggers let the owner of the
    # tables through: whoever migrates (a superuser, say), the two must be the same role.
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_attempt"},
    ).scalar_one()
    quoted_owner = bind.dialect.identifier_preparer.quote_identifier(owner)
    for function in (*_PURGE_FUNCTIONS, "outbox_purge_open_run(bigint)"):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quoted_owner}")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_no_replace")
    elif bind.dialect.name == "postgresql":
        s = _schema()
        for function in _PURGE_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
        op.execute(f"DROP FUNCTION IF EXISTS {s}.outbox_purge_open_run(bigint)")
        for trigger in ("outbox_retention_run_no_truncate", "outbox_retention_run_written_by_purge"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {s}.outbox_retention_run")
        op.execute(f"DROP FUNCTION IF EXISTS {s}.outbox_retention_run_written_by_purge()")
        op.execute(_PG_0006_APPEND_ONLY)
        op.execute(_PG_0001_NOTIFY)
    op.drop_column("outbox_retention_run", "history_of_unresolved")
    op.drop_column("outbox_retention_run", "db_user")
