"""Create outbox_message and outbox_attempt, the NOTIFY and append-only triggers.

Revision ID: outbox_0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0001"
down_revision = None
branch_labels = ("outbox",)
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_TS = sa.DateTime(timezone=True)
_PENDING = sa.text("status = 'pending'")
_RUNNING = sa.text("status = 'running'")
_GROUPED = sa.text("group_key IS NOT NULL")

# NOTIFY once per transaction: a statement-level trigger, and PostgreSQL folds
# identical notifications of one transaction into one. The payload names the
# schema so relays sharing a database across schemas can ignore the others'.
_PG_NOTIFY = """
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox', TG_TABLE_SCHEMA);
    RETURN NULL;
END
$$
"""

# History is evidence: nothing may rewrite it. The retention command (the only
# sanctioned deleter) sets outbox.retention = 'on' for its own transaction.
_PG_APPEND_ONLY = """
CREATE FUNCTION outbox_attempt_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('outbox.retention', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'outbox_attempt is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'history rows leave only through the outbox retention command (outbox purge)';
END
$$
"""

# SQLite: DELETE is allowed only on a connection where the retention command
# registered outbox_purge_in_progress(); anywhere else the name does not resolve
# and the statement is refused before it touches a row.
_SQLITE_TRIGGERS = (
    """
    CREATE TRIGGER outbox_attempt_no_update BEFORE UPDATE ON outbox_attempt
    BEGIN
        SELECT RAISE(ABORT, 'outbox_attempt is append-only: UPDATE is not allowed');
    END
    """,
    """
    CREATE TRIGGER outbox_attempt_no_delete BEFORE DELETE ON outbox_attempt
    WHEN outbox_purge_in_progress() IS NOT 1
    BEGIN
        SELECT RAISE(ABORT, 'outbox_attempt is append-only: DELETE is allowed only through outbox purge');
    END
    """,
)


def upgrade() -> None:
    op.create_table(
        "outbox_message",
        sa.Column("id", _ID, sa.Identity(), primary_key=True),
        sa.Column("event_id", sa.Uuid(), nullable=False),
        sa.Column("event_type", sa.String(255), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("queue", sa.String(255), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("payload", _JSON, nullable=False),
        sa.Column("headers", _JSON, nullable=False),
        sa.Column("aggregate_type", sa.String(255)),
        sa.Column("aggregate_id", sa.String(255)),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("group_key", sa.String(255)),
        sa.Column("status", sa.String(16), nullable=False, server_default=sa.text("'pending'")),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("available_at", _TS, nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("locked_by", sa.String(255)),
        sa.Column("locked_until", _TS),
        sa.Column("delivered_at", _TS),
        sa.Column("last_error", sa.Text()),
        sa.Column(
            "requeued_from",
            _ID,
            sa.ForeignKey("outbox_message.id", name="fk_outbox_message_requeued_from_outbox_message"),
        ),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_message"),
        sa.UniqueConstraint("handler", "idempotency_key", name="uq_outbox_message_handler_idempotency_key"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'delivered', 'dead', 'discarded')",
            name=op.f("ck_outbox_message_status"),
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_outbox_message_attempts")),
        sa.CheckConstraint("max_attempts >= 1", name=op.f("ck_outbox_message_max_attempts")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_outbox_message_claim",
        "outbox_message",
        ["queue", "priority", "id"],
        postgresql_where=_PENDING,
        sqlite_where=_PENDING,
    )
    op.create_index(
        "ix_outbox_message_lease",
        "outbox_message",
        ["locked_until"],
        postgresql_where=_RUNNING,
        sqlite_where=_RUNNING,
    )
    op.create_index(
        "ix_outbox_message_group",
        "outbox_message",
        ["handler", "group_key", "id"],
        postgresql_where=_GROUPED,
        sqlite_where=_GROUPED,
    )
    op.create_index("ix_outbox_message_status_handler", "outbox_message", ["status", "handler"])
    op.create_index("ix_outbox_message_event_id", "outbox_message", ["event_id"])
    op.create_index("ix_outbox_message_aggregate", "outbox_message", ["aggregate_type", "aggregate_id"])

    op.create_table(
        "outbox_attempt",
        sa.Column("id", _ID, sa.Identity(), primary_key=True),
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
        sa.CheckConstraint(
            "outcome IN ('delivered', 'retry', 'failed', 'dead', 'timeout', 'lease_expired', "
            "'requeued', 'discarded')",
            name=op.f("ck_outbox_attempt_outcome"),
        ),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_outbox_attempt_message_id", "outbox_attempt", ["message_id", "attempt"])
    op.create_index("ix_outbox_attempt_started_at", "outbox_attempt", ["started_at"])

    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute(_PG_NOTIFY)
        op.execute(
            "CREATE TRIGGER outbox_message_notify AFTER INSERT ON outbox_message "
            "FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()"
        )
        op.execute(_PG_APPEND_ONLY)
        op.execute(
            "CREATE TRIGGER outbox_attempt_append_only BEFORE UPDATE OR DELETE ON outbox_attempt "
            "FOR EACH ROW EXECUTE FUNCTION outbox_attempt_append_only()"
        )
        op.execute(
            "CREATE TRIGGER outbox_attempt_no_truncate BEFORE TRUNCATE ON outbox_attempt "
            "FOR EACH STATEMENT EXECUTE FUNCTION outbox_attempt_append_only()"
        )
    elif dialect == "sqlite":
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_no_truncate ON outbox_attempt")
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_append_only ON outbox_attempt")
        op.execute("DROP TRIGGER IF EXISTS outbox_message_notify ON outbox_message")
    elif dialect == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_no_delete")
        op.execute("DROP TRIGGER IF EXISTS outbox_attempt_no_update")
    op.drop_table("outbox_attempt")
    op.drop_table("outbox_message")
    if dialect == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS outbox_attempt_append_only()")
        op.execute("DROP FUNCTION IF EXISTS outbox_notify()")
