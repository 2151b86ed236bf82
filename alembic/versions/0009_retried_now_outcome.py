"""A history outcome for ``outbox retry-now``: ``retried_now``.

Revision ID: outbox_0009
Revises: outbox_0008
Create Date: 2026-12-04

``outbox retry-now`` makes pending messages that wait out a backoff due at
once, and records that on each of them like requeue and discard do: a history
row with the actor and the reason. None of the existing outcomes says that
(``requeued`` means a new copy was made), so the check constraint on
``outbox_attempt.outcome`` gains ``retried_now``.

PostgreSQL checks the new constraint against every history row once, holding a
lock that makes the relay's history writes wait meanwhile (a sequential read of
the table: about a second per few million rows).

SQLite cannot change a check constraint in place: the table is rebuilt with its
rows, indexes and ``AUTOINCREMENT`` counter, and the append-only triggers of
``outbox_0001``, ``outbox_0007`` and ``outbox_0008`` are created again on it.

The downgrade refuses while ``retried_now`` rows exist: history is never
rewritten, and the old constraint would reject them.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "outbox_0009"
down_revision = "outbox_0008"
branch_labels = None
depends_on = None

_BEFORE = ("delivered", "retry", "failed", "dead", "timeout", "lease_expired", "requeued", "discarded")
_AFTER = (*_BEFORE, "retried_now")
_NAME = "ck_outbox_attempt_outcome"

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


def upgrade() -> None:
    _allow(_AFTER)


def downgrade() -> None:
    recorded = (
        op.get_bind()
        .execute(sa.text("SELECT count(*) FROM outbox_attempt WHERE outcome = 'retried_now'"))
        .scalar_one()
    )
    if recorded:
        raise RuntimeError(
            f"cannot downgrade below outbox_0009: {recorded} history row(s) record a retry-now,"
            " and history is never rewritten"
        )
    _allow(_BEFORE)
