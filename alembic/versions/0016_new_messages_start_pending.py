"""A message inserted by anyone but the tables' owner starts pending; pause log rows name the login.

Revision ID: outbox_0016
Revises: outbox_0015
Create Date: 2026-12-13

The least-privilege guide gives the application INSERT only on the columns
``emit()`` writes, so its rows take the defaults for the rest: ``pending``, no
attempts, no lock, no lineage (``requeued_from``). That holds only while the
grants are exactly the guide's; a role given a table-wide INSERT (an older
guide did, and so does ``GRANT ALL``) could insert a "delivered" copy whose
``requeued_from`` points at a dead message, and bury it: the dead count,
alerts, ``requeue`` and the purge's "unresolved" test all trust that link.

PostgreSQL now refuses such a row from every role but the owner, whatever the
grants: row-level security on ``outbox_message`` with an INSERT policy whose
check is the state a new message must have. A policy, not a trigger: it is an
expression PostgreSQL evaluates in C with the row, where a PL/pgSQL trigger
cost a non-owner's emit 30 to 115 µs per row in the emit benchmark. Refusing
is louder than rewriting the row, too. The owner (whom the ``SECURITY DEFINER``
functions run as, so requeue can set the lineage), superusers and roles with
BYPASSRLS are not subject to it; reading, updating and deleting keep their
permissive policies, so privileges alone decide them, as before.

``outbox_pause_log`` gains ``db_user``: the login that paused or resumed,
written by a trigger from ``session_user`` beside the ``actor`` label (and the
log row's ``at`` from the database clock), as history rows carry
``detail.db_user``. Earlier rows, and every row on SQLite, have NULL.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0016"
down_revision = "outbox_0015"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"

#: What a row must look like when it is inserted (by anyone but the owner).
NEW_MESSAGE = (
    "status = 'pending' AND attempts = 0 AND locked_by IS NULL AND locked_until IS NULL"
    " AND delivered_at IS NULL AND last_error IS NULL AND requeued_from IS NULL"
)


def upgrade() -> None:
    op.add_column("outbox_pause_log", sa.Column("db_user", sa.String(255), nullable=True))
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    s = bind.dialect.identifier_preparer.quote_identifier(
        bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    )
    op.execute(f"ALTER TABLE {s}.outbox_message ENABLE ROW LEVEL SECURITY")
    op.execute(
        f"CREATE POLICY outbox_new_message ON {s}.outbox_message FOR INSERT WITH CHECK ({NEW_MESSAGE})"
    )
    for command in ("SELECT", "UPDATE", "DELETE"):
        op.execute(f"CREATE POLICY outbox_{command.lower()} ON {s}.outbox_message FOR {command} USING (true)")
    op.execute(
        f"""
CREATE FUNCTION {s}.outbox_pause_log_stamped() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
BEGIN
    NEW.db_user := session_user;
    NEW.at := now();
    RETURN NEW;
END
$$
"""
    )
    op.execute(
        f"CREATE TRIGGER outbox_pause_log_stamped BEFORE INSERT ON {s}.outbox_pause_log"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_pause_log_stamped()"
    )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        s = bind.dialect.identifier_preparer.quote_identifier(
            bind.execute(sa.text("SELECT current_schema()")).scalar_one()
        )
        op.execute(f"DROP TRIGGER IF EXISTS outbox_pause_log_stamped ON {s}.outbox_pause_log")
        op.execute(f"DROP FUNCTION IF EXISTS {s}.outbox_pause_log_stamped()")
        for policy in ("outbox_new_message", "outbox_select", "outbox_update", "outbox_delete"):
            op.execute(f"DROP POLICY IF EXISTS {policy} ON {s}.outbox_message")
        op.execute(f"ALTER TABLE {s}.outbox_message DISABLE ROW LEVEL SECURITY")
    # Not a batch operation: on SQLite that rebuilds the table and drops its append-only triggers.
    op.execute("ALTER TABLE outbox_pause_log DROP COLUMN db_user")
