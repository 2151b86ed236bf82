"""Circuit breakers shared by every relay: ``outbox_breaker`` and its append-only log.

Revision ID: outbox_0019
Revises: outbox_0018
Create Date: 2026-12-15

A webhook handler's breaker lived in each relay process's memory. With two
relays each learned an outage on its own and kept sending; ``outbox
retry-now`` made messages due and the running relay deferred them again at
once, its breaker still open; nothing could reset a breaker; and a relay's
successful half-open trial closed only its own.

``outbox_breaker`` now holds one row per destination whose breaker is open
(until ``reopen_at``) or half-open (after it): the route whose deliveries
opened it (``handler``), the relay that did (``opened_by``), the consecutive
failures it saw, ``opened_at`` and ``updated_at`` (the last opening or
reopening). Every relay reads it about once a second and skips what is open; a
successful trial deletes the row, and so do ``outbox breaker reset`` and
``outbox retry-now`` of a message the breaker held back. ``outbox_breaker_log``
records each opening, closing and reset with the relay id or the operator's
actor and reason, and refuses UPDATE, DELETE and TRUNCATE like the pause log.

PostgreSQL does every write in ``SECURITY DEFINER`` functions owned by the
tables' owner, ``search_path`` pinned, EXECUTE revoked from PUBLIC, each
stamping its log row with the database clock and the login (``db_user``, as a
trigger also does for any other insert): the relay's ``outbox_breaker_open``
and ``outbox_breaker_close``, the operator's ``outbox_breaker_reset``. The
least-privilege block in docs/operations.md grants the relay SELECT on
``outbox_breaker`` and EXECUTE on its two, the operator SELECT on both tables
and EXECUTE on the reset. SQLite has no roles: the relay and ``outbox.ops``
write the same rows themselves there.

Both tables are new: nothing is rewritten, no lock is taken on a busy table. A
relay of this version on a database not migrated this far keeps its breakers
to itself and says so once. The downgrade refuses while the log holds a row
(the record is never destroyed); open breakers are dropped with their table,
and each relay keeps its own.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "outbox_0019"
down_revision = "outbox_0018"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TS = sa.DateTime(timezone=True)
_PINNED = "SET search_path = pg_catalog, pg_temp"
#: The longest cool-down the database records: a month.
MAX_COOLDOWN = 2_592_000

RELAY_FUNCTIONS = (
    "outbox_breaker_open(text, text, text, integer, double precision)",
    "outbox_breaker_close(text, text)",
)
OPERATOR_FUNCTIONS = ("outbox_breaker_reset(text[], text[], text, text, text)",)
_TRIGGER_FUNCTIONS = ("outbox_breaker_log_append_only()", "outbox_breaker_log_stamped()")

_SQLITE_TRIGGERS = (
    "CREATE TRIGGER outbox_breaker_log_no_update BEFORE UPDATE ON outbox_breaker_log"
    " BEGIN SELECT RAISE(ABORT, 'outbox_breaker_log is append-only: UPDATE is not allowed'); END",
    "CREATE TRIGGER outbox_breaker_log_no_delete BEFORE DELETE ON outbox_breaker_log"
    " BEGIN SELECT RAISE(ABORT, 'outbox_breaker_log is append-only: DELETE is not allowed'); END",
    "CREATE TRIGGER outbox_breaker_log_no_replace BEFORE INSERT ON outbox_breaker_log"
    " WHEN EXISTS (SELECT 1 FROM outbox_breaker_log WHERE id = NEW.id)"
    " BEGIN SELECT RAISE(ABORT, 'outbox_breaker_log is append-only:"
    " REPLACE or UPSERT may not rewrite an existing row'); END",
)


def _checked(value: str, what: str, limit: int) -> str:
    """PL/pgSQL refusing a NULL, blank or too long text argument."""
    return f"""
    IF {value} IS NULL OR btrim({value}) = '' OR length({value}) > {limit} THEN
        RAISE EXCEPTION 'outbox breaker: {what} of 1 to {limit} characters is required'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;"""


def _pg_sql(s: str) -> list[str]:
    """Every function and trigger, with ``s`` the quoted schema the outbox tables live in."""
    return [
        f"""
CREATE FUNCTION {s}.outbox_breaker_log_append_only() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
BEGIN
    RAISE EXCEPTION 'outbox_breaker_log is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$
""",
        f"CREATE TRIGGER outbox_breaker_log_append_only BEFORE UPDATE OR DELETE ON {s}.outbox_breaker_log"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_breaker_log_append_only()",
        f"CREATE TRIGGER outbox_breaker_log_no_truncate BEFORE TRUNCATE ON {s}.outbox_breaker_log"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_breaker_log_append_only()",
        f"""
CREATE FUNCTION {s}.outbox_breaker_log_stamped() RETURNS trigger LANGUAGE plpgsql {_PINNED} AS $$
BEGIN
    NEW.db_user := session_user;
    NEW.at := now();
    RETURN NEW;
END
$$
""",
        f"CREATE TRIGGER outbox_breaker_log_stamped BEFORE INSERT ON {s}.outbox_breaker_log"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_breaker_log_stamped()",
        f"""
CREATE FUNCTION {s}.outbox_breaker_open(
    me text, dest text, route text, seen_failures integer, cooldown double precision
) RETURNS void LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    found_at timestamptz;
BEGIN
    {_checked("me", "a relay id", 255)}
    {_checked("dest", "a destination", 1000)}
    {_checked("route", "a route name", 255)}
    IF seen_failures IS NULL OR seen_failures < 1 THEN
        RAISE EXCEPTION 'outbox breaker: a breaker opens after at least one failure'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- NaN and infinity fail the comparison too.
    IF cooldown IS NULL OR NOT (cooldown > 0 AND cooldown <= {MAX_COOLDOWN}) THEN
        RAISE EXCEPTION 'outbox breaker: a cool-down of more than 0 and at most {MAX_COOLDOWN} seconds'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT b.reopen_at INTO found_at FROM {s}.outbox_breaker b WHERE b.destination = dest FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO {s}.outbox_breaker
            (destination, handler, failures, opened_at, reopen_at, opened_by, updated_at)
        VALUES (dest, route, seen_failures, now(), now() + cooldown * interval '1 second', me, now())
        ON CONFLICT (destination) DO NOTHING;  -- another relay opened it meanwhile: that opening stands
        IF FOUND THEN
            INSERT INTO {s}.outbox_breaker_log (event, destination, handler, at, relay_id, failures, db_user)
            VALUES ('opened', dest, route, now(), me, seen_failures, session_user);
        END IF;
    ELSIF found_at <= now() THEN
        -- Half-open: this failure is a trial's (or came with one), so it opens for a cool-down again.
        -- The same outage: no log row, only the time.
        UPDATE {s}.outbox_breaker b
           SET failures = b.failures + 1, reopen_at = now() + cooldown * interval '1 second',
               updated_at = now()
         WHERE b.destination = dest;
    END IF;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_breaker_close(me text, dest text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
DECLARE
    route text;
BEGIN
    {_checked("me", "a relay id", 255)}
    DELETE FROM {s}.outbox_breaker b WHERE b.destination = dest RETURNING b.handler INTO route;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO {s}.outbox_breaker_log (event, destination, handler, at, relay_id, db_user)
    VALUES ('closed', dest, route, now(), me, session_user);
    RETURN true;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_breaker_reset(
    destinations text[], routes text[], actor text, reason text, what text
) RETURNS TABLE (
    reset_destination text, reset_handler text, reset_failures integer, reset_opened_at timestamptz,
    reset_reopen_at timestamptz, reset_opened_by text
) LANGUAGE plpgsql SECURITY DEFINER {_PINNED} AS $$
BEGIN
    {_checked("actor", "an actor", 255)}
    IF reason IS NULL OR btrim(reason) = '' THEN
        RAISE EXCEPTION 'outbox breaker: a reason is required: it is what the log will say'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF what IS NULL OR what NOT IN ('reset', 'retried_now') THEN
        RAISE EXCEPTION 'outbox breaker: a reset is logged as reset or retried_now'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    WITH gone AS (
        DELETE FROM {s}.outbox_breaker b
         WHERE b.destination = ANY (coalesce(destinations, '{{}}'::text[]))
            OR b.handler = ANY (coalesce(routes, '{{}}'::text[]))
        RETURNING b.destination, b.handler, b.failures, b.opened_at, b.reopen_at, b.opened_by
    ), logged AS (
        INSERT INTO {s}.outbox_breaker_log (event, destination, handler, at, actor, reason, db_user)
        SELECT what, g.destination, g.handler, now(), actor, reason, session_user FROM gone g
    )
    SELECT g.destination::text, g.handler::text, g.failures, g.opened_at, g.reopen_at, g.opened_by::text
      FROM gone g ORDER BY g.destination;
END
$$
""",
    ]


def upgrade() -> None:
    op.create_table(
        "outbox_breaker",
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("opened_at", _TS, nullable=False),
        sa.Column("reopen_at", _TS, nullable=False),
        sa.Column("opened_by", sa.String(255), nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("destination", name="pk_outbox_breaker"),
        sa.CheckConstraint("failures >= 1", name=op.f("ck_outbox_breaker_failures")),
    )
    op.create_table(
        "outbox_breaker_log",
        sa.Column("id", _ID, sa.Identity(), nullable=False),
        sa.Column("event", sa.String(16), nullable=False),
        sa.Column("destination", sa.Text(), nullable=False),
        sa.Column("handler", sa.String(255), nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("relay_id", sa.String(255)),
        sa.Column("actor", sa.String(255)),
        sa.Column("reason", sa.Text()),
        sa.Column("failures", sa.Integer()),
        sa.Column("db_user", sa.String(255)),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_breaker_log"),
        sa.CheckConstraint(
            "event IN ('opened', 'closed', 'reset', 'retried_now')", name=op.f("ck_outbox_breaker_log_event")
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_outbox_breaker_log_destination", "outbox_breaker_log", ["destination", "id"], unique=False
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
    for function in (*RELAY_FUNCTIONS, *OPERATOR_FUNCTIONS, *_TRIGGER_FUNCTIONS):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {quote(owner)}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")
    for table in ("outbox_breaker", "outbox_breaker_log"):
        op.execute(f"ALTER TABLE {s}.{table} OWNER TO {quote(owner)}")


def downgrade() -> None:
    bind = op.get_bind()
    logged = bind.execute(sa.text("SELECT count(*) FROM outbox_breaker_log")).scalar_one()
    if logged:
        raise RuntimeError(
            f"cannot downgrade below outbox_0019: outbox_breaker_log records {logged} opening(s),"
            " closing(s) and reset(s) of circuit breakers, a record that is never destroyed"
        )
    if bind.dialect.name == "postgresql":
        s = bind.dialect.identifier_preparer.quote_identifier(
            bind.execute(sa.text("SELECT current_schema()")).scalar_one()
        )
        for function in (*RELAY_FUNCTIONS, *OPERATOR_FUNCTIONS):
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
        for trigger in (
            "outbox_breaker_log_stamped",
            "outbox_breaker_log_no_truncate",
            "outbox_breaker_log_append_only",
        ):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {s}.outbox_breaker_log")
    op.drop_index("ix_outbox_breaker_log_destination", table_name="outbox_breaker_log")
    op.drop_table("outbox_breaker_log")
    op.drop_table("outbox_breaker")
    if bind.dialect.name == "postgresql":
        for function in _TRIGGER_FUNCTIONS:
            op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
