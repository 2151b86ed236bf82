"""Purge floors are checked on the cutoff timestamps, not on the intervals that make them.

Revision ID: outbox_0013
Revises: outbox_0012
Create Date: 2026-12-11

``outbox_purge_start`` checked its arguments as intervals: ``history_older_than``
had to be at least ``1 day`` and ``delivered_older_than`` zero or more. But
PostgreSQL compares intervals counting a month as 30 days, while
``now() - interval`` steps calendar months: ``interval '-12 mon 361 days'``
passes "at least one day" and yet lands the history cutoff four days in the
future, so the run's steps delete every history row. The same shape gets
``delivered_older_than`` past "zero or more".

The function now computes both cutoffs from one reading of the database clock
first, then checks the cutoffs themselves: delivered messages must have
finished before the run started, and history must be at least 24 hours old
(24 hours, not ``1 day``: a day across a daylight-saving change in the
session's time zone is 23 or 25 of them). The grants and the owner of the
function do not change (``CREATE OR REPLACE`` keeps both).

SQLite: the purge runs in Python, which computes cutoffs from timedeltas
(no months) and checked them already; nothing changes there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0013"
down_revision = "outbox_0012"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"

#: The checks revision outbox_0007 made, restored by the downgrade.
_INTERVAL_CHECKS = """
    IF delivered_older_than IS NULL OR delivered_older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox purge: delivered_older_than must be zero or more, got %', delivered_older_than
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF history_older_than < interval '1 day' THEN
        RAISE EXCEPTION 'outbox purge: history_older_than must be at least 1 day, got %',
                        history_older_than
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'history younger than 1 day is never purged';
    END IF;"""

_CUTOFF_CHECKS = """
    IF delivered_older_than IS NULL THEN
        RAISE EXCEPTION 'outbox purge: delivered_older_than is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF delivered_before > started THEN
        RAISE EXCEPTION 'outbox purge: delivered_older_than % puts the cutoff after now (%)',
                        delivered_older_than, delivered_before
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'give an age that reaches back: zero or more, in any units';
    END IF;
    IF history_before > started - interval '24 hours' THEN
        RAISE EXCEPTION 'outbox purge: history_older_than % puts the cutoff at %, less than 24 hours ago',
                        history_older_than, history_before
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'history younger than 24 hours is never purged';
    END IF;"""


def _purge_start(s: str, checks: str) -> str:
    """``outbox_purge_start`` with ``checks`` run once the run's cutoffs are computed."""
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_purge_start(
    actor text,
    delivered_older_than interval,
    history_older_than interval DEFAULT NULL,
    history_of_unresolved boolean DEFAULT false
) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    run_id bigint;
    started timestamptz := now();
    delivered_before timestamptz := started - delivered_older_than;
    history_before timestamptz := started - history_older_than;
BEGIN
    IF actor IS NULL OR btrim(actor) = '' OR length(actor) > 255 THEN
        RAISE EXCEPTION 'outbox purge: an actor of 1 to 255 characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;{checks}
    IF history_of_unresolved IS NULL THEN
        RAISE EXCEPTION 'outbox purge: history_of_unresolved must be true or false'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO {s}.outbox_retention_run
        (started_at, actor, db_user, delivered_before, history_before, history_of_unresolved)
    VALUES (started, actor, session_user, delivered_before, history_before,
            history_older_than IS NOT NULL AND history_of_unresolved)
    RETURNING id INTO run_id;
    RETURN run_id;
END
$$
"""


def _schema() -> str:
    bind = op.get_bind()
    name = bind.execute(sa.text("SELECT current_schema()")).scalar_one()
    return bind.dialect.identifier_preparer.quote_identifier(name)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_purge_start(_schema(), _CUTOFF_CHECKS))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_purge_start(_schema(), _INTERVAL_CHECKS))
