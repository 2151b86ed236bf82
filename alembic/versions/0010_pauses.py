"""Pausing a queue or a handler: ``outbox_pause`` and its append-only log, ``outbox_pause_log``.

Revision ID: outbox_0010
Revises: outbox_0009
Create Date: 2026-12-08

``outbox pause`` holds back a queue or a handler: relays stop claiming its
messages, which stay pending with their schedule untouched, until ``outbox
resume``. ``outbox_pause`` holds what is paused now, one row per queue or
handler; every claim reads it (a handful of rows, usually none). Every pause
and resume is also appended to ``outbox_pause_log`` with its actor and reason;
like ``outbox_attempt``, the log refuses UPDATE, DELETE and TRUNCATE (triggers
here), so it is the complete record of who held what back, when and why.

Both tables are new: nothing is rewritten, no lock is taken on a busy table.

The downgrade refuses while anything is paused (dropping the table would
resume it silently) or while the log holds a row (the record is never
destroyed).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0010"
down_revision = "outbox_0009"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)
_KINDS = "kind IN ('queue', 'handler')"

_PG_APPEND_ONLY = """
CREATE FUNCTION outbox_pause_log_append_only() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'outbox_pause_log is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$
"""

_SQLITE_TRIGGERS = (
    "CREATE TRIGGER outbox_pause_log_no_update BEFORE UPDATE ON outbox_pause_log"
    " BEGIN SELECT RAISE(ABORT, 'outbox_pause_log is append-only: UPDATE is not allowed'); END",
    "CREATE TRIGGER outbox_pause_log_no_delete BEFORE DELETE ON outbox_pause_log"
    " BEGIN SELECT RAISE(ABORT, 'outbox_pause_log is append-only: DELETE is not allowed'); END",
    "CREATE TRIGGER outbox_pause_log_no_replace BEFORE INSERT ON outbox_pause_log"
    " WHEN EXISTS (SELECT 1 FROM outbox_pause_log WHERE id = NEW.id)"
    " BEGIN SELECT RAISE(ABORT, 'outbox_pause_log is append-only:"
    " REPLACE or UPSERT may not rewrite an existing row'); END",
)


def upgrade() -> None:
    op.create_table(
        "outbox_pause",
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("paused_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("kind", "name", name="pk_outbox_pause"),
        sa.CheckConstraint(_KINDS, name="kind"),
    )
    op.create_table(
        "outbox_pause_log",
        sa.Column("id", _ID, sa.Identity(), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_pause_log"),
        sa.CheckConstraint("event IN ('paused', 'resumed')", name="event"),
        sa.CheckConstraint(_KINDS, name="kind"),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_outbox_pause_log_kind_name", "outbox_pause_log", ["kind", "name", "id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_APPEND_ONLY)
        op.execute(
            "CREATE TRIGGER outbox_pause_log_append_only BEFORE UPDATE OR DELETE ON outbox_pause_log"
            " FOR EACH ROW EXECUTE FUNCTION outbox_pause_log_append_only()"
        )
        op.execute(
            "CREATE TRIGGER outbox_pause_log_no_truncate BEFORE TRUNCATE ON outbox_pause_log"
            " FOR EACH STATEMENT EXECUTE FUNCTION outbox_pause_log_append_only()"
        )
    elif op.get_bind().dialect.name == "sqlite":
        for statement in _SQLITE_TRIGGERS:
            op.execute(statement)


def downgrade() -> None:
    bind = op.get_bind()
    paused = bind.execute(sa.text("SELECT count(*) FROM outbox_pause")).scalar_one()
    logged = bind.execute(sa.text("SELECT count(*) FROM outbox_pause_log")).scalar_one()
    if paused or logged:
        raise RuntimeError(
            f"cannot downgrade below outbox_0010: {paused} queue(s) or handler(s) are paused"
            f" (dropping outbox_pause would resume them) and outbox_pause_log records {logged}"
            " pause(s) and resume(s), a record that is never destroyed"
        )
    if bind.dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS outbox_pause_log_no_truncate ON outbox_pause_log")
        op.execute("DROP TRIGGER IF EXISTS outbox_pause_log_append_only ON outbox_pause_log")
    op.drop_index("ix_outbox_pause_log_kind_name", table_name="outbox_pause_log")
    op.drop_table("outbox_pause_log")
    op.drop_table("outbox_pause")
    if bind.dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS outbox_pause_log_append_only()")
