"""An operator's actions run inside the database, which writes their history and log rows.

Revision ID: outbox_0014
Revises: outbox_0013
Create Date: 2026-12-12

Requeue, discard, retry-now, pause and resume wrote their rows from the
operator's login: that role needed INSERT and UPDATE on ``outbox_message``,
INSERT on ``outbox_attempt`` and ``outbox_pause_log``, INSERT and DELETE on
``outbox_pause``. With those it could also do any of it without a trace: set a
status by hand, forge a ``requeued`` row that hides a dead message from the
purge's "unresolved" test and from the alerts, pause a queue with no log row,
or stamp a log row with any time and actor; and every timestamp came from the
operator host's clock (a host an hour fast made a requeued copy wait an hour).

PostgreSQL now does each of them in a ``SECURITY DEFINER`` function owned by
the tables' owner, with ``search_path`` pinned: ``outbox_requeue``,
``outbox_discard``, ``outbox_retry_now``, ``outbox_pause``, ``outbox_resume``.
Each locks the rows it acts on, checks their state again under the lock
(``strict``: refuse the whole call if one changed; else skip it), and writes
its history or log row with the database clock; a history row's ``detail``
names the login (``db_user``, ``session_user``) beside the actor label. EXECUTE
is revoked from PUBLIC: the least-privilege block in docs/operations.md grants
it to the operator and no longer grants that role any INSERT, UPDATE or DELETE
on those tables.

SQLite has no roles: ``outbox.ops`` writes the same rows itself there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0014"
down_revision = "outbox_0013"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"

ACTION_FUNCTIONS = (
    "outbox_requeue(bigint[], text[], text, text, boolean)",
    "outbox_discard(bigint[], text, text, boolean)",
    "outbox_retry_now(bigint[], text, text, boolean, boolean)",
    "outbox_pause(text, text, text, text)",
    "outbox_resume(text, text, text, text)",
)
_HELPERS = (
    "outbox_action_checked(text, text)",
    "outbox_action_recorded(bigint, integer, text, text, text, text, jsonb)",
)


def _sql(s: str, schema_name: str) -> list[str]:
    """Every function, ``s`` the quoted schema and ``schema_name`` its name as NOTIFY sends it."""
    changed = """RAISE EXCEPTION 'outbox %: message % changed meanwhile; try again', verb, ids[i]
                    USING ERRCODE = 'object_not_in_prerequisite_state'"""
    channel = "'" + schema_name.replace("'", "''") + "'"
    return [
        f"""
CREATE FUNCTION {s}.outbox_action_checked(actor text, reason text) RETURNS void
LANGUAGE plpgsql {_PINNED} AS $$
BEGIN
    IF actor IS NULL OR btrim(actor) = '' OR length(actor) > 255 THEN
        RAISE EXCEPTION 'outbox: an actor of 1 to 255 characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'outbox: a reason is required: it is what the audit trail will say'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_action_recorded(
    message_id bigint, attempt integer, previous_status text, outcome text, actor text, reason text,
    detail jsonb
) RETURNS void LANGUAGE sql {_PINNED} AS $$
    INSERT INTO {s}.outbox_attempt
        (message_id, attempt, outcome, started_at, finished_at, duration_ms, actor, reason, detail)
    VALUES (message_id, attempt, outcome, now(), now(), 0, actor, reason,
            detail || jsonb_build_object('previous_status', previous_status, 'db_user', session_user))
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_requeue(ids bigint[], copy_keys text[], actor text, reason text, strict boolean)
RETURNS TABLE (old_id bigint, new_id bigint)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    verb text := 'requeue';
    old {s}.outbox_message;
    copy_id bigint;
    suffix text;
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    IF cardinality(ids) IS DISTINCT FROM cardinality(copy_keys) THEN
        RAISE EXCEPTION 'outbox requeue: one copy key (or NULL) per message id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        SELECT * INTO old FROM {s}.outbox_message o WHERE o.id = ids[i] FOR UPDATE;
        -- Requeued once at most: a second copy would deliver the event twice.
        IF NOT FOUND OR old.status NOT IN ('dead', 'discarded')
           OR EXISTS (SELECT 1 FROM {s}.outbox_message c WHERE c.requeued_from = old.id) THEN
            IF strict THEN
                {changed};
            END IF;
            CONTINUE;
        END IF;
        suffix := '~requeue:' || old.id;
        IF (old.idempotency_key IS NULL) <> (copy_keys[i] IS NULL)
           OR (copy_keys[i] IS NOT NULL AND (right(copy_keys[i], length(suffix)) <> suffix
                                             OR length(copy_keys[i]) > 255)) THEN
            RAISE EXCEPTION 'outbox requeue: the copy of message % needs a key ending in %', old.id, suffix
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        INSERT INTO {s}.outbox_message
            (event_id, event_type, handler, queue, priority, payload, headers, aggregate_type,
             aggregate_id, idempotency_key, group_key, status, attempts, max_attempts, available_at,
             created_at, updated_at, requeued_from)
        VALUES (old.event_id, old.event_type, old.handler, old.queue, old.priority, old.payload,
                old.headers, old.aggregate_type, old.aggregate_id, copy_keys[i], old.group_key,
                'pending', 0, old.max_attempts, now(), now(), now(), old.id)
        RETURNING id INTO copy_id;
        PERFORM {s}.outbox_action_recorded(old.id, old.attempts, old.status, 'requeued', actor, reason,
                                           jsonb_build_object('new_id', copy_id));
        old_id := old.id;
        new_id := copy_id;
        RETURN NEXT;
    END LOOP;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_discard(ids bigint[], actor text, reason text, strict boolean)
RETURNS SETOF bigint LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    verb text := 'discard';
    msg {s}.outbox_message;
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        SELECT * INTO msg FROM {s}.outbox_message o WHERE o.id = ids[i] FOR UPDATE;
        IF NOT FOUND OR msg.status NOT IN ('pending', 'dead') THEN
            IF strict THEN
                {changed};
            END IF;
            CONTINUE;
        END IF;
        UPDATE {s}.outbox_message o
           SET status = 'discarded', updated_at = now(), locked_by = NULL, locked_until = NULL
         WHERE o.id = msg.id;
        PERFORM {s}.outbox_action_recorded(msg.id, msg.attempts, msg.status, 'discarded', actor, reason,
                                           '{{}}'::jsonb);
        RETURN NEXT msg.id;
    END LOOP;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_retry_now(
    ids bigint[], actor text, reason text, include_delayed boolean, strict boolean
) RETURNS SETOF bigint LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    verb text := 'retry-now';
    msg {s}.outbox_message;
    woken boolean := false;
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    FOR i IN 1 .. coalesce(cardinality(ids), 0) LOOP
        SELECT * INTO msg FROM {s}.outbox_message o WHERE o.id = ids[i] FOR UPDATE;
        -- Waiting out a backoff; a delay asked for at emit (never attempted) only when included.
        IF NOT FOUND OR msg.status <> 'pending' OR msg.available_at <= now()
           OR NOT (include_delayed
                   OR EXISTS (SELECT 1 FROM {s}.outbox_attempt h WHERE h.message_id = msg.id)) THEN
            IF strict THEN
                {changed};
            END IF;
            CONTINUE;
        END IF;
        UPDATE {s}.outbox_message o SET available_at = now(), updated_at = now() WHERE o.id = msg.id;
        PERFORM {s}.outbox_action_recorded(msg.id, msg.attempts, msg.status, 'retried_now', actor, reason,
                                           jsonb_build_object('was_due_at', msg.available_at));
        woken := true;
        RETURN NEXT msg.id;
    END LOOP;
    IF woken THEN  -- the NOTIFY trigger fires on INSERT only: wake the relays here
        PERFORM pg_notify('outbox', {channel});
    END IF;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_pause(target_kind text, target_name text, actor text, reason text)
RETURNS TABLE (paused_reason text, paused_actor text, paused_at timestamptz, changed boolean)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    INSERT INTO {s}.outbox_pause (kind, name, reason, actor, paused_at)
    VALUES (target_kind, target_name, reason, actor, now())
    ON CONFLICT (kind, name) DO NOTHING;
    IF FOUND THEN
        INSERT INTO {s}.outbox_pause_log (event, kind, name, at, actor, reason)
        VALUES ('paused', target_kind, target_name, now(), actor, reason);
        RETURN QUERY SELECT reason, actor, now(), true;
    ELSE  -- paused already: nothing changes, nothing is logged
        RETURN QUERY SELECT p.reason::text, p.actor::text, p.paused_at, false
                       FROM {s}.outbox_pause p WHERE p.kind = target_kind AND p.name = target_name;
    END IF;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_resume(target_kind text, target_name text, actor text, reason text)
RETURNS TABLE (paused_reason text, paused_actor text, paused_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    ended {s}.outbox_pause;
BEGIN
    PERFORM {s}.outbox_action_checked(actor, reason);
    DELETE FROM {s}.outbox_pause p WHERE p.kind = target_kind AND p.name = target_name
    RETURNING * INTO ended;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'outbox resume: % % is not paused', target_kind, target_name
            USING ERRCODE = 'no_data_found';
    END IF;
    INSERT INTO {s}.outbox_pause_log (event, kind, name, at, actor, reason)
    VALUES ('resumed', target_kind, target_name, now(), actor, reason);
    PERFORM pg_notify('outbox', {channel});  -- what was held back is claimed now, not at the next poll
    RETURN QUERY SELECT ended.reason::text, ended.actor::text, ended.paused_at;
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
    for statement in _sql(s, schema_name):
        op.execute(statement)
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_message"},
    ).scalar_one()
    quoted_owner = bind.dialect.identifier_preparer.quote_identifier(owner)
    for function in (*ACTION_FUNCTIONS, *_HELPERS):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quoted_owner}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    s = bind.dialect.identifier_preparer.quote_identifier(
        bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    )
    for function in (*ACTION_FUNCTIONS, *_HELPERS):
        op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
