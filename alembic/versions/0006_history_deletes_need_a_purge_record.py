"""History rows may be deleted only by a recorded purge, and only those older than its cutoff.

Revision ID: outbox_0006
Revises: outbox_0005
Create Date: 2026-12-03

Until now the append-only trigger let a DELETE through whenever the session had
set ``outbox.retention = 'on'``: any session could, and nothing recorded it.
Now the setting must name an unfinished ``outbox_retention_run`` row, and the
deleted row must be older than that run's ``history_before``. Deleting history
therefore always leaves a record (who, when, which cutoff), and cannot reach
rows newer than the cutoff that record states. (SQLite is unchanged: an
embedded database file is open to whoever holds it.)
"""

from __future__ import annotations

from alembic import op

revision = "outbox_0006"
down_revision = "outbox_0005"
branch_labels = None
depends_on = None

_REFUSE = """
    RAISE EXCEPTION 'outbox_attempt is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'history rows leave only through the outbox retention command (outbox purge)';
"""

_RECORDED_PURGES_ONLY = f"""
CREATE OR REPLACE FUNCTION outbox_attempt_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    purge text := current_setting('outbox.retention', true);
BEGIN
    IF TG_OP = 'DELETE' AND purge ~ '^[0-9]{{1,18}}$' AND EXISTS (
        SELECT 1 FROM outbox_retention_run r
         WHERE r.id = purge::bigint AND r.finished_at IS NULL
           AND r.history_before IS NOT NULL AND OLD.started_at < r.history_before
    ) THEN
        RETURN OLD;
    END IF;
    {_REFUSE}
END
$$
"""

_ANY_SESSION_THAT_ASKS = f"""
CREATE OR REPLACE FUNCTION outbox_attempt_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('outbox.retention', true) = 'on' THEN
        RETURN OLD;
    END IF;
    {_REFUSE}
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_RECORDED_PURGES_ONLY)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_ANY_SESSION_THAT_ASKS)
