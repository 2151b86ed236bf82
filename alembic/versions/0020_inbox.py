"""The inbox: markers, dead letters and log offsets of consumers, and markers in the purge.

Revision ID: outbox_0020
Revises: outbox_0019
Create Date: 2026-12-17

The outbox delivers at least once; exactly-once effects need the consumer to
record each message id in its own transaction, with the effects. Three new
tables:

- ``outbox_inbox``: one marker per consumer (an ``outbox.Inbox``'s name) and
  message id, primary key (consumer, message_id), written with ``INSERT ... ON
  CONFLICT DO NOTHING`` by ``Inbox.receive``. ``received_at`` defaults to the
  database's clock; ``kept_until`` is ``received_at`` plus the inbox's
  ``keep``, indexed for retention. Markers are never updated, and leave only
  through a purge once ``kept_until`` has passed: the trigger
  ``outbox_inbox_kept`` refuses UPDATE and TRUNCATE to everyone, and DELETE to
  all but the tables' owner inside a purge run (``outbox.retention`` naming an
  unfinished ``outbox_retention_run``), and only of markers whose
  ``kept_until`` is before the run started. A marker purged too early would let
  a redelivered message take effect twice.
- ``outbox_inbox_dead``: dead letters, one per consumer and message id, with
  payload, headers, error and a status for the requeue that follows
  (``dead``, ``requeued``, ``handled``). Its trigger refuses DELETE and
  TRUNCATE to everyone and UPDATE to all but the owner: the record is kept.
- ``outbox_inbox_offset``: a partitioned log's next offset per consumer,
  topic and partition, stored in the same transaction as the effects.

``outbox_retention_run`` gains ``markers_deleted`` (0 for runs before), and
PostgreSQL gains ``outbox_inbox_purge_step(run_id, batch_size)``: one batch of
expired markers deleted and counted in the run, in the same transaction, by a
``SECURITY DEFINER`` function owned by the tables' owner, ``search_path``
pinned, EXECUTE revoked from PUBLIC (the least-privilege block grants it to
the operator), which refuses the same runs as ``outbox_purge_step``. ``outbox
purge`` calls it after its other steps. SQLite: triggers refuse UPDATE of a
marker and DELETE outside a purge; the purge deletes expired markers itself.

All three tables are new: no lock is taken on a busy table. The downgrade
refuses while a dead letter exists (the record is never destroyed) or a marker
is still within its window (dropping it would let a redelivery take effect
again); purge first.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0020"
down_revision = "outbox_0019"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_PINNED = "SET search_path = pg_catalog, pg_temp"
#: Rows one purge step may delete at most, as for outbox_purge_step (outbox_0007).
MAX_BATCH = 10000

OPERATOR_FUNCTIONS = ("outbox_inbox_purge_step(bigint, integer)",)
_TRIGGER_FUNCTIONS = ("outbox_inbox_kept()", "outbox_inbox_dead_kept()")

_SQLITE_TRIGGERS = (
    "CREATE TRIGGER outbox_inbox_no_update BEFORE UPDATE ON outbox_inbox"
    " BEGIN SELECT RAISE(ABORT, 'outbox_inbox markers are never changed: UPDATE is not allowed'); END",
    "CREATE TRIGGER outbox_inbox_no_delete BEFORE DELETE ON outbox_inbox"
    " WHEN outbox_purge_in_progress() IS NOT 1"
    " BEGIN SELECT RAISE(ABORT,"
    " 'outbox_inbox markers are kept until kept_until: DELETE is allowed only through outbox purge'); END",
    "CREATE TRIGGER outbox_inbox_dead_no_delete BEFORE DELETE ON outbox_inbox_dead"
    " BEGIN SELECT RAISE(ABORT, 'outbox_inbox_dead is a record: DELETE is not allowed'); END",
)


def _pg_sql(s: str) -> list[str]:
    """Every function and trigger, with ``s`` the quoted schema the outbox tables live in."""
    owner_is_current_user = (
        "pg_catalog.pg_get_userbyid(c.relowner) = current_user"
        " FROM pg_catalog.pg_class c WHERE c.oid = TG_RELID"
    )
    return [
        # Non-owners are refused before any table is read: no SELECT needed, nothing to shadow.
        f"""
CREATE FUNCTION {s}.outbox_inbox_kept() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    purge text := current_setting('outbox.retention', true);
    owner_acts boolean;
BEGIN
    IF TG_OP = 'DELETE' THEN
        SELECT {owner_is_current_user} INTO owner_acts;
        IF owner_acts AND purge ~ '^[0-9]{{1,18}}$' AND EXISTS (
            SELECT 1 FROM {s}.outbox_retention_run r
             WHERE r.id = purge::bigint AND r.finished_at IS NULL AND OLD.kept_until < r.started_at
        ) THEN
            RETURN OLD;
        END IF;
    END IF;
    RAISE EXCEPTION 'outbox_inbox markers are kept until kept_until: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'markers leave only through the outbox retention command (outbox purge), once expired';
END
$$
""",
        f"CREATE TRIGGER outbox_inbox_kept BEFORE UPDATE OR DELETE ON {s}.outbox_inbox"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_inbox_kept()",
        f"CREATE TRIGGER outbox_inbox_no_truncate BEFORE TRUNCATE ON {s}.outbox_inbox"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_inbox_kept()",
        f"""
CREATE FUNCTION {s}.outbox_inbox_dead_kept() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
DECLARE
    owner_acts boolean;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        SELECT {owner_is_current_user} INTO owner_acts;
        IF owner_acts THEN
            RETURN NEW;
        END IF;
    END IF;
    RAISE EXCEPTION 'outbox_inbox_dead is a record: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'dead letters change only through the outbox functions that requeue them';
END
$$
""",
        f"CREATE TRIGGER outbox_inbox_dead_kept BEFORE UPDATE OR DELETE ON {s}.outbox_inbox_dead"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_inbox_dead_kept()",
        f"CREATE TRIGGER outbox_inbox_dead_no_truncate BEFORE TRUNCATE ON {s}.outbox_inbox_dead"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_inbox_dead_kept()",
        f"""
CREATE FUNCTION {s}.outbox_inbox_purge_step(run_id bigint, batch_size integer) RETURNS integer
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
    PERFORM set_config('outbox.retention', run.id::text, true);
    DELETE FROM {s}.outbox_inbox d
     WHERE (d.consumer, d.message_id) IN (
        SELECT i.consumer, i.message_id FROM {s}.outbox_inbox i
         WHERE i.kept_until < run.started_at
         ORDER BY i.kept_until LIMIT batch_size);
    GET DIAGNOSTICS deleted = ROW_COUNT;
    PERFORM set_config('outbox.retention', '', true);
    IF deleted > 0 THEN
        UPDATE {s}.outbox_retention_run r SET markers_deleted = r.markers_deleted + deleted
         WHERE r.id = run.id;
    END IF;
    RETURN deleted;
END
$$
""",
    ]


def upgrade() -> None:
    op.create_table(
        "outbox_inbox",
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("received_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.Column("kept_until", _TS, nullable=False),
        sa.Column("event_type", sa.String(255)),
        sa.Column("source", sa.String(255)),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="pk_outbox_inbox"),
        sa.CheckConstraint(
            "outcome IN ('received', 'handled', 'unhandled', 'dead')", name=op.f("ck_outbox_inbox_outcome")
        ),
        sa.CheckConstraint("kept_until > received_at", name=op.f("ck_outbox_inbox_kept_until")),
    )
    op.create_index("ix_outbox_inbox_kept_until", "outbox_inbox", ["kept_until"], unique=False)
    op.create_table(
        "outbox_inbox_offset",
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("consumer", "topic", "partition", name="pk_outbox_inbox_offset"),
        sa.CheckConstraint("partition >= 0", name=op.f("ck_outbox_inbox_offset_partition")),
        sa.CheckConstraint("next_offset >= 0", name=op.f("ck_outbox_inbox_offset_next_offset")),
    )
    op.create_table(
        "outbox_inbox_dead",
        sa.Column("id", _ID, sa.Identity(), nullable=False),
        sa.Column("consumer", sa.String(255), nullable=False),
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("event_type", sa.String(255), nullable=False),
        sa.Column("source", sa.String(255)),
        sa.Column("payload", _JSON, nullable=False),
        sa.Column("headers", _JSON, nullable=False),
        sa.Column("sent_at", _TS),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error_type", sa.String(255), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("dead_at", _TS, nullable=False, server_default=sa.func.now()),
        sa.Column("status", sa.String(16), nullable=False, server_default=sa.literal_column("'dead'")),
        sa.Column("requeued_at", _TS),
        sa.Column("actor", sa.String(255)),
        sa.Column("reason", sa.Text()),
        sa.Column("handled_at", _TS),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_inbox_dead"),
        sa.UniqueConstraint("consumer", "message_id", name="uq_outbox_inbox_dead_consumer_message_id"),
        sa.CheckConstraint(
            "status IN ('dead', 'requeued', 'handled')", name=op.f("ck_outbox_inbox_dead_status")
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_outbox_inbox_dead_attempts")),
        sqlite_autoincrement=True,
    )
    op.add_column(
        "outbox_retention_run",
        sa.Column("markers_deleted", sa.Integer(), nullable=False, server_default=sa.literal_column("0")),
    )
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)
        return
    if bind.dialect.name != "postgresql":
        return
    quote = bind.dialect.identifier_preparer.quote_identifier
    s = quote(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    for statement in _pg_sql(s):
        op.execute(statement)
    # SECURITY DEFINER runs as the function's owner, which must own the tables (see outbox_0007).
    owner = bind.execute(
        sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:table AS regclass)"),
        {"table": f"{s}.outbox_message"},
    ).scalar_one()
    for function in (*OPERATOR_FUNCTIONS, *_TRIGGER_FUNCTIONS):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quote(owner)}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")
    for table in ("outbox_inbox", "outbox_inbox_offset", "outbox_inbox_dead"):
        op.execute(f"ALTER TABLE {s}.{table} OWNER TO {quote(owner)}")


def downgrade() -> None:
    bind = op.get_bind()
    dead = bind.execute(sa.text("SELECT count(*) FROM outbox_inbox_dead")).scalar_one()
    if dead:
        raise RuntimeError(
            f"cannot downgrade below outbox_0020: outbox_inbox_dead records {dead} dead letter(s),"
            " a record that is never destroyed"
        )
    now = "now()" if bind.dialect.name == "postgresql" else "strftime('%Y-%m-%d %H:%M:%f', 'now')"
    kept = bind.execute(sa.text(f"SELECT count(*) FROM outbox_inbox WHERE kept_until >= {now}")).scalar_one()
    if kept:
        raise RuntimeError(
            f"cannot downgrade below outbox_0020: outbox_inbox holds {kept} marker(s) still within their"
            " inbox's window; without them a redelivered message would take effect again"
        )
    if bind.dialect.name == "postgresql":
        s = bind.dialect.identifier_preparer.quote_identifier(
            bind.execute(sa.text("SELECT current_schema()")).scalar_one()
        )
        for function in OPERATOR_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
    op.drop_column("outbox_retention_run", "markers_deleted")
    op.drop_table("outbox_inbox_dead")
    op.drop_table("outbox_inbox_offset")
    op.drop_index("ix_outbox_inbox_kept_until", table_name="outbox_inbox")
    op.drop_table("outbox_inbox")
    if bind.dialect.name == "postgresql":
        for function in _TRIGGER_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
