"""History in daily partitions on PostgreSQL: the purge drops whole days instead of deleting rows.

Revision ID: outbox_0024
Revises: outbox_0023
Create Date: 2026-12-20

A purge deleted old history row by row, in batches: at ten million history
rows a day, a day's purge was ten million deletes, each leaving a dead tuple
that vacuum then had to find. ``outbox_attempt`` is now range-partitioned on
``started_at``, the column the purge's cutoff is compared with, one partition
per UTC day (``outbox_attempt_pYYYYMMDD``) plus a DEFAULT partition
(``outbox_attempt_default``) that takes a row no day partition covers, so a
missing partition never loses a history write. The table keeps its name, its
columns and its ids; queries, grants and the functions that write it do not
change. The primary key becomes ``(id, started_at)`` (PostgreSQL requires the
partition key in it); ids still come from one identity sequence.

The upgrade rebuilds the table in place, in one transaction: the old table is
renamed, the partitioned one created with a partition for every day that has
history and for the next seven, the rows copied with their ids, the identity
sequence carried on, then the indexes, the append-only triggers (a ``BEFORE``
row trigger on a partitioned table runs on every partition; the TRUNCATE
trigger is added to each partition too, since statement triggers are not
inherited), the grants and the owner. The downgrade copies the rows back into
one table the same way.

New functions:

- ``outbox_history_partitions_ahead(days integer DEFAULT 7) RETURNS integer``
  (``SECURITY DEFINER``, pinned like the others): creates the partitions of
  today and the next ``days`` UTC days that do not exist, and returns how many
  it created. It changes nothing when they exist. A day whose rows already sit
  in the DEFAULT partition (no relay ran it ahead) gets its partition all the
  same: the DEFAULT partition is detached, the day's partition and a new,
  empty DEFAULT created, its rows re-inserted with their ids (each lands in
  its partition) and the old one dropped, in one transaction, so no row is
  lost or rewritten. Relays call it at start-up and every hour; every purge
  calls it too. It waits at most 2 s for the table's lock.
- ``outbox_attempt_partitions()``: the day partitions and their bounds (an
  internal helper; EXECUTE revoked from PUBLIC).

The purge functions change:

- ``outbox_purge_start`` rounds the history cutoff down to the start of the
  partition it falls in (midnight UTC), after checking the 24-hour floor on
  the cutoff as asked: a purge never cuts a partition in two, and the record's
  ``history_before`` is the cutoff it applied, which is at least as old as the
  one asked for.
- ``outbox_purge_step`` drops, one partition per step, each day partition that
  ends at or before the cutoff: it locks the partition against writes, counts
  its rows, keeps the history of unresolved messages (unless the run purges
  that too) by re-inserting those rows with their ids once the partition is
  detached (they land in the DEFAULT partition, since no partition covers
  their day any more), drops the partition, and adds the count it removed to
  the run in the same transaction. Older history in the DEFAULT partition is
  then deleted row by row, as before. The append-only trigger is unchanged: a
  row is still deleted only inside an unfinished run, by the owner, when older
  than the run's cutoff; DETACH and DROP are the owner's alone.

SQLite: nothing changes; the purge deletes rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from outbox.migrations.revisions import earlier

revision = "outbox_0024"
down_revision = "outbox_0023"
branch_labels = None
depends_on = None

_PINNED = "SET search_path = pg_catalog, pg_temp"
#: Bounds are printed and parsed in UTC, ISO, whatever the caller's session says.
_UTC = "SET \"TimeZone\" = 'UTC' SET \"DateStyle\" = 'ISO, YMD'"
#: Days after today whose partitions exist from the start.
DAYS_AHEAD = 7
#: Rows one purge step may delete row by row at most (outbox_0007).
MAX_BATCH = 10000

AHEAD = "outbox_history_partitions_ahead(integer)"
#: The advisory lock that makes and drops history partitions one transaction at a time.
_PARTITIONS_LOCK = "hashtext('outbox_attempt partitions')"
_HELPERS = ("outbox_attempt_partitions()", "outbox_attempt_partition_for(date)")


def _unresolved(s: str) -> str:
    """A message still waiting on a relay or an operator (outbox_0007), as ``m``."""
    return f"""
        m.status IN ('pending', 'running')
        OR (m.status = 'dead'
            AND NOT EXISTS (SELECT 1 FROM {s}.outbox_message c WHERE c.requeued_from = m.id)
            AND NOT EXISTS (SELECT 1 FROM {s}.outbox_attempt r
                             WHERE r.message_id = m.id AND r.outcome = 'requeued'))"""


def _no_truncate(s: str, table: str) -> str:
    return (
        f"CREATE TRIGGER outbox_attempt_no_truncate BEFORE TRUNCATE ON {s}.{table}"
        f" FOR EACH STATEMENT EXECUTE FUNCTION {s}.outbox_attempt_append_only()"
    )


def _functions(s: str) -> list[str]:
    """The partition functions, for ``s`` the quoted schema."""
    parent = f"{s}.outbox_attempt"
    # The schema as a string literal: the parent and the DEFAULT partition are looked up by name.
    namespace = "'" + s.replace("'", "''") + "'::regnamespace"
    return [
        f"""
CREATE FUNCTION {s}.outbox_attempt_partitions()
RETURNS TABLE (part regclass, lower_bound timestamptz, upper_bound timestamptz)
LANGUAGE sql STABLE {_PINNED} {_UTC} AS $$
    SELECT c.oid::regclass,
           (regexp_match(b.bound, 'FROM \\(''([^'']*)''\\)'))[1]::timestamptz,
           (regexp_match(b.bound, 'TO \\(''([^'']*)''\\)'))[1]::timestamptz
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
      CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = (SELECT t.oid FROM pg_class t
                           WHERE t.relname = 'outbox_attempt' AND t.relnamespace = {namespace})
       AND b.bound LIKE 'FOR VALUES FROM %'
$$
""",
        # Not SECURITY DEFINER: called by the functions below (and the migration) as the owner.
        f"""
CREATE FUNCTION {s}.outbox_attempt_partition_for(day date) RETURNS boolean
LANGUAGE plpgsql {_PINNED} {_UTC} AS $$
DECLARE
    part text := 'outbox_attempt_p' || to_char(day, 'YYYYMMDD');
    day_start timestamptz := day::timestamp AT TIME ZONE 'UTC';
    day_end timestamptz := (day + 1)::timestamp AT TIME ZONE 'UTC';
    create_day text;
    moving boolean := false;
BEGIN
    IF EXISTS (SELECT 1 FROM {s}.outbox_attempt_partitions() p
                WHERE p.lower_bound < day_end AND p.upper_bound > day_start) THEN
        RETURN false;
    END IF;
    create_day := format('CREATE TABLE {s}.%I PARTITION OF {parent} FOR VALUES FROM (%L) TO (%L)',
                         part, day_start, day_end);
    IF EXISTS (SELECT 1 FROM pg_class t
                WHERE t.relname = 'outbox_attempt_default' AND t.relnamespace = {namespace}) THEN
        moving := EXISTS (SELECT 1 FROM {s}.outbox_attempt_default d
                           WHERE d.started_at >= day_start AND d.started_at < day_end);
    END IF;
    IF moving THEN
        -- PostgreSQL refuses a partition for rows the DEFAULT partition holds. Move them, ids and
        -- all, without deleting a row: the old DEFAULT partition is detached, its rows inserted
        -- again (each lands in its partition), and the detached table dropped.
        ALTER TABLE {parent} DETACH PARTITION {s}.outbox_attempt_default;
        ALTER TABLE {s}.outbox_attempt_default RENAME TO outbox_attempt_default_moved;
        EXECUTE create_day;
        EXECUTE format('{_no_truncate(s, "%I")}', part);
        CREATE TABLE {s}.outbox_attempt_default PARTITION OF {parent} DEFAULT;
        {_no_truncate(s, "outbox_attempt_default")};
        INSERT INTO {parent} OVERRIDING SYSTEM VALUE SELECT * FROM {s}.outbox_attempt_default_moved;
        DROP TABLE {s}.outbox_attempt_default_moved;
    ELSE
        EXECUTE create_day;
        EXECUTE format('{_no_truncate(s, "%I")}', part);
    END IF;
    RETURN true;
END
$$
""",
        f"""
CREATE FUNCTION {s}.outbox_history_partitions_ahead(days integer DEFAULT {DAYS_AHEAD}) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} {_UTC} SET lock_timeout = '2s' AS $$
DECLARE
    today date := (now() AT TIME ZONE 'UTC')::date;
    created integer := 0;
BEGIN
    IF days IS NULL OR days < 0 OR days > 366 THEN
        RAISE EXCEPTION 'outbox: days ahead must be 0 to 366, got %', days
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One caller at a time (relays start together, a purge may run beside them): the next one
    -- then finds the partitions made.
    PERFORM pg_advisory_xact_lock({_PARTITIONS_LOCK});
    FOR d IN 0..days LOOP
        IF {s}.outbox_attempt_partition_for(today + d) THEN
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$
""",
    ]


def _purge_start(s: str) -> str:
    """outbox_0013's ``outbox_purge_start``, its history cutoff rounded down to a partition's start."""
    body: str = earlier("0013")._purge_start(s, earlier("0013")._CUTOFF_CHECKS)
    marker = "    INSERT INTO"
    rounding = f"""    -- A purge drops whole days: the cutoff moves back to the start of the day it falls in.
    SELECT p.lower_bound INTO rounded FROM {s}.outbox_attempt_partitions() p
     WHERE p.lower_bound <= history_before AND history_before < p.upper_bound;
    IF FOUND THEN
        history_before := rounded;
    END IF;
    -- Tomorrow's partitions, whoever else makes them; a busy table is left for the next purge.
    BEGIN
        PERFORM {s}.outbox_history_partitions_ahead({DAYS_AHEAD});
    EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
        NULL;
    END;
"""
    body = body.replace("    run_id bigint;\n", "    run_id bigint;\n    rounded timestamptz;\n", 1)
    assert marker in body and "rounded timestamptz" in body
    return body.replace(marker, rounding + marker, 1)


def _purge_step(s: str) -> str:
    unresolved = _unresolved(s)
    # The same condition inside a format() string literal: one line, quotes doubled.
    unresolved_literal = " ".join(unresolved.split()).replace("'", "''")
    return f"""
CREATE OR REPLACE FUNCTION {s}.outbox_purge_step(run_id bigint, batch_size integer)
RETURNS TABLE (messages_deleted integer, attempts_deleted integer)
LANGUAGE plpgsql SECURITY DEFINER {_PINNED} SET lock_timeout = '2s' AS $$
DECLARE
    run {s}.outbox_retention_run;
    deleted integer;
    day record;
    total bigint;
    kept bigint[];
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
        -- Whole days older than the cutoff: the partition is dropped, not emptied row by row. Its
        -- rows are locked against writes while they are counted and the kept ones found; the
        -- kept ones are inserted again, ids and all, once no partition covers their day (they
        -- land in the DEFAULT partition).
        PERFORM pg_advisory_xact_lock({_PARTITIONS_LOCK});  -- no two steps drop the same day
        FOR day IN SELECT p.part FROM {s}.outbox_attempt_partitions() p
                    WHERE p.upper_bound <= run.history_before ORDER BY p.lower_bound LOOP
            EXECUTE format('LOCK TABLE %s IN SHARE MODE', day.part);
            EXECUTE format('SELECT count(*) FROM %s', day.part) INTO total;
            kept := '{{}}';
            IF NOT run.history_of_unresolved THEN
                EXECUTE format('SELECT coalesce(array_agg(h.id), ''{{}}'') FROM {s}.outbox_message m'
                               ' JOIN %s h ON h.message_id = m.id'
                               ' WHERE m.status IN (''pending'', ''running'', ''dead'')'
                               ' AND ({unresolved_literal})',
                               day.part) INTO kept;
            END IF;
            EXECUTE format('ALTER TABLE {s}.outbox_attempt DETACH PARTITION %s', day.part);
            IF cardinality(kept) > 0 THEN
                EXECUTE format('INSERT INTO {s}.outbox_attempt OVERRIDING SYSTEM VALUE'
                               ' SELECT * FROM %s h WHERE h.id = ANY($1)', day.part) USING kept;
            END IF;
            EXECUTE format('DROP TABLE %s', day.part);
            deleted := total - cardinality(kept);
            IF deleted > 0 THEN
                UPDATE {s}.outbox_retention_run r SET attempts_deleted = r.attempts_deleted + deleted
                 WHERE r.id = run.id;
                RETURN QUERY SELECT 0, deleted;
                RETURN;
            END IF;
        END LOOP;

        -- What no dropped day held (the DEFAULT partition): row by row, as before.
        PERFORM set_config('outbox.retention', run.id::text, true);
        DELETE FROM {s}.outbox_attempt d
         WHERE d.id IN (
            SELECT h.id FROM {s}.outbox_attempt h
             WHERE h.started_at < run.history_before
               AND (run.history_of_unresolved OR NOT EXISTS (
                    SELECT 1 FROM {s}.outbox_message m WHERE m.id = h.message_id AND ({unresolved})))
             ORDER BY h.id LIMIT batch_size)
           AND d.started_at < run.history_before;
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
"""


def _purge_step_0007(s: str) -> str:
    """outbox_0007's ``outbox_purge_step``, for the downgrade."""
    statements: list[str] = earlier("0007")._pg_upgrade_sql(s)
    (step,) = [x for x in statements if f"CREATE FUNCTION {s}.outbox_purge_step(" in x]
    return step.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _schema() -> tuple[str, str]:
    bind = op.get_bind()
    name = str(bind.execute(sa.text("SELECT current_schema()")).scalar_one())
    return bind.dialect.identifier_preparer.quote_identifier(name), name


def _owner(s: str) -> str:
    owner = (
        op.get_bind()
        .execute(
            sa.text("SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = CAST(:t AS regclass)"),
            {"t": f"{s}.outbox_attempt"},
        )
        .scalar_one()
    )
    return str(op.get_bind().dialect.identifier_preparer.quote_identifier(owner))


def _grants(s: str, table: str) -> list[str]:
    """GRANT statements that give ``table``'s privileges (table and column) to the same roles again."""
    bind = op.get_bind()
    quote = bind.dialect.identifier_preparer.quote_identifier
    rows = bind.execute(
        sa.text(
            "SELECT NULL AS col, a.grantee, a.privilege_type, a.is_grantable"
            " FROM pg_class c, aclexplode(c.relacl) a"
            " WHERE c.oid = CAST(:t AS regclass) AND a.grantee <> c.relowner"
            " UNION ALL"
            " SELECT t.attname, a.grantee, a.privilege_type, a.is_grantable"
            " FROM pg_class c JOIN pg_attribute t ON t.attrelid = c.oid, aclexplode(t.attacl) a"
            " WHERE c.oid = CAST(:t AS regclass) AND NOT t.attisdropped AND a.grantee <> c.relowner"
        ),
        {"t": f"{s}.{table}"},
    ).all()
    names: dict[int, str] = {
        int(r[0]): str(r[1]) for r in bind.execute(sa.text("SELECT oid, rolname FROM pg_roles"))
    }
    grants = []
    for column, grantee, privilege, grantable in rows:
        who = "PUBLIC" if grantee == 0 else quote(names[grantee])
        on = f"{privilege} ({quote(column)})" if column is not None else privilege
        option = " WITH GRANT OPTION" if grantable else ""
        grants.append(f"GRANT {on} ON {s}.outbox_attempt TO {who}{option}")
    return grants


def _rebuild(s: str, *, partitioned: bool) -> None:
    """Replace ``outbox_attempt`` by a copy, partitioned or not, keeping rows, ids, sequence and rights."""
    bind = op.get_bind()
    owner = _owner(s)
    grants = _grants(s, "outbox_attempt")
    sequence = bind.execute(
        sa.text("SELECT pg_get_serial_sequence(:t, 'id')"), {"t": f"{s}.outbox_attempt"}
    ).scalar_one()
    op.execute(f"LOCK TABLE {s}.outbox_attempt IN ACCESS EXCLUSIVE MODE")
    op.execute(f"ALTER TABLE {s}.outbox_attempt RENAME TO outbox_attempt_old")
    op.execute(f"ALTER SEQUENCE {sequence} RENAME TO outbox_attempt_old_id_seq")
    for index in ("pk_outbox_attempt", "ux_outbox_attempt_once", "ix_outbox_attempt_started_at"):
        op.execute(f"ALTER INDEX {s}.{index} RENAME TO {index}_old")
    op.execute(
        f"CREATE TABLE {s}.outbox_attempt (LIKE {s}.outbox_attempt_old INCLUDING DEFAULTS"
        " INCLUDING CONSTRAINTS INCLUDING IDENTITY INCLUDING STORAGE INCLUDING COMMENTS)"
        + (" PARTITION BY RANGE (started_at)" if partitioned else "")
    )
    op.execute(f"ALTER TABLE {s}.outbox_attempt OWNER TO {owner}")
    if partitioned:
        op.execute(f"CREATE TABLE {s}.outbox_attempt_default PARTITION OF {s}.outbox_attempt DEFAULT")
        op.execute(_no_truncate(s, "outbox_attempt_default"))
        days = bind.execute(
            sa.text(
                "SELECT d::date FROM generate_series("
                " least((SELECT min(started_at) FROM outbox_attempt_old) AT TIME ZONE 'UTC',"
                "       now() AT TIME ZONE 'UTC')::date,"
                " (now() AT TIME ZONE 'UTC')::date + :ahead, interval '1 day') AS d"
            ),
            {"ahead": DAYS_AHEAD},
        ).scalars()
        for day in list(days):
            op.execute(sa.text(f"SELECT {s}.outbox_attempt_partition_for(:day)").bindparams(day=day))
        # The owner check of the append-only trigger reads each partition's owner.
        for (part,) in bind.execute(
            sa.text(
                "SELECT inhrelid::regclass::text FROM pg_inherits WHERE inhparent = CAST(:t AS regclass)"
            ),
            {"t": f"{s}.outbox_attempt"},
        ).all():
            op.execute(f"ALTER TABLE {part} OWNER TO {owner}")
    op.execute(f"INSERT INTO {s}.outbox_attempt OVERRIDING SYSTEM VALUE SELECT * FROM {s}.outbox_attempt_old")
    # The identity sequence carries on where the old one was: new rows continue the ids.
    op.execute(
        f"SELECT setval(pg_get_serial_sequence('{s}.outbox_attempt', 'id'), s.last_value, s.is_called)"
        f" FROM {s}.outbox_attempt_old_id_seq s"
    )
    key = "id, started_at" if partitioned else "id"
    op.execute(f"ALTER TABLE {s}.outbox_attempt ADD CONSTRAINT pk_outbox_attempt PRIMARY KEY ({key})")
    op.execute(
        f"CREATE UNIQUE INDEX ux_outbox_attempt_once ON {s}.outbox_attempt"
        " (message_id, attempt, outcome, started_at)"
    )
    op.execute(f"CREATE INDEX ix_outbox_attempt_started_at ON {s}.outbox_attempt (started_at)")
    op.execute(
        f"CREATE TRIGGER outbox_attempt_append_only BEFORE UPDATE OR DELETE ON {s}.outbox_attempt"
        f" FOR EACH ROW EXECUTE FUNCTION {s}.outbox_attempt_append_only()"
    )
    op.execute(_no_truncate(s, "outbox_attempt"))
    for grant in grants:
        op.execute(grant)
    # The old table's triggers refuse TRUNCATE, not DROP; its sequence goes with it.
    op.execute(f"DROP TABLE {s}.outbox_attempt_old")
    op.execute(f"ANALYZE {s}.outbox_attempt")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s, _ = _schema()
    owner = _owner(s)
    for statement in _functions(s):
        op.execute(statement)
    for function in (*_HELPERS, AHEAD):
        op.execute(f"ALTER FUNCTION {s}.{function} OWNER TO {owner}")
        op.execute(f"REVOKE EXECUTE ON FUNCTION {s}.{function} FROM PUBLIC")
    _rebuild(s, partitioned=True)
    # CREATE OR REPLACE of the same signatures: the functions keep their owner and their grants.
    op.execute(_purge_start(s))
    op.execute(_purge_step(s))


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    s, _ = _schema()
    _rebuild(s, partitioned=False)
    op.execute(earlier("0013")._purge_start(s, earlier("0013")._CUTOFF_CHECKS))
    op.execute(_purge_step_0007(s))
    for function in (AHEAD, *reversed(_HELPERS)):
        op.execute(f"DROP FUNCTION IF EXISTS {s}.{function}")
