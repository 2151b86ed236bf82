"""The outbox Alembic branch: round trip, no drift from the table definitions, the app recipe, the CLI."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, inspect, text
from sqlalchemy.engine import make_url

import outbox
from outbox.integrations.email import email_metadata
from outbox.integrations.report import report_metadata

OUTBOX_TABLES = {
    "outbox_message",
    "outbox_attempt",
    "outbox_retention_run",
    "outbox_pause",
    "outbox_pause_log",
    "outbox_relay_registry",
    "outbox_breaker",
    "outbox_breaker_log",
    "outbox_inbox",
    "outbox_inbox_dead",
    "outbox_inbox_offset",
    "outbox_report_run",
    "outbox_report_chunk",
    "outbox_email_sent",
}


def database_objects(url: str) -> tuple[set[str], set[str]]:
    """Tables, and triggers plus functions, that exist in the database.

    The daily partitions of outbox_attempt on PostgreSQL (outbox_0024) are part of that one table.
    """
    engine = create_engine(url)
    try:
        tables = set(inspect(engine).get_table_names()) - {"alembic_version", outbox.VERSION_TABLE}
        partitions = {t for t in tables if outbox._migrations.is_history_partition(t)}
        assert not partitions or engine.dialect.name == "postgresql", partitions
        tables -= partitions
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                rows = conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'"))
            else:
                rows = conn.execute(
                    text(
                        "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal"
                        " UNION SELECT proname FROM pg_proc WHERE proname LIKE 'outbox%'"
                    )
                )
            routines = {r[0] for r in rows}
    finally:
        engine.dispose()
    return tables, routines


def test_upgrade_downgrade_upgrade_round_trip(empty_url):
    outbox.upgrade(empty_url)
    tables, routines = database_objects(empty_url)
    assert tables == OUTBOX_TABLES
    assert any("append" in r or "no_update" in r for r in routines), routines

    outbox._migrations.downgrade(empty_url)
    assert database_objects(empty_url) == (set(), set())

    outbox.upgrade(empty_url)
    assert database_objects(empty_url)[0] == OUTBOX_TABLES


def _not_a_partition(obj, name, type_, reflected, compare_to):
    """outbox_attempt's daily partitions (PostgreSQL, outbox_0024) are that table, not tables of their own."""
    table = name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)
    return not outbox._migrations.is_history_partition(table)


def test_migrated_schema_matches_the_table_definitions(database_url):
    engine = create_engine(database_url)
    combined = MetaData()
    for source in (outbox.metadata, report_metadata, email_metadata):
        for table in source.tables.values():
            table.to_metadata(combined)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "compare_server_default": False,
                    "version_table": outbox.VERSION_TABLE,
                    "include_object": _not_a_partition,
                },
            )
            diff = compare_metadata(context, combined)
    finally:
        engine.dispose()
    assert diff == [], f"migrations and table definitions disagree: {diff}"
    # compare_metadata does not look at check constraints; their names are part of the schema too.
    engine = create_engine(database_url)
    try:
        inspector = inspect(engine)
        for table in combined.tables.values():
            expected = {c.name for c in table.constraints if c.__class__.__name__ == "CheckConstraint"}
            assert {c["name"] for c in inspector.get_check_constraints(table.name)} == expected, table.name
    finally:
        engine.dispose()


def write_app_alembic(folder: Path, url: str) -> Path:
    """An application's own Alembic environment that includes the outbox branch (the documented recipe)."""
    (folder / "versions").mkdir(parents=True)
    (folder / "app_models.py").write_text(
        textwrap.dedent(
            """
            from sqlalchemy import Column, Integer, MetaData, String, Table

            metadata = MetaData()
            customers = Table(
                "customers", metadata, Column("id", Integer, primary_key=True), Column("name", String(50))
            )
            """
        )
    )
    (folder / "env.py").write_text(
        textwrap.dedent(
            """
            import sys
            from pathlib import Path

            from alembic import context
            from sqlalchemy import create_engine

            import outbox

            sys.path.insert(0, str(Path(__file__).parent))
            from app_models import metadata

            config = context.config
            engine = create_engine(config.get_main_option("sqlalchemy.url"))
            with engine.connect() as connection:
                context.configure(
                    connection=connection,
                    target_metadata=metadata,
                    include_object=outbox.include_object,
                )
                with context.begin_transaction():
                    context.run_migrations()
            """
        )
    )
    (folder / "script.py.mako").write_text(
        (outbox._migrations.script_location() / "script.py.mako").read_text()
    )
    (folder / "versions" / "app_0001.py").write_text(
        textwrap.dedent(
            """
            import sqlalchemy as sa
            from alembic import op

            revision = "app_0001"
            down_revision = None
            branch_labels = ("app",)
            depends_on = None

            def upgrade():
                op.create_table(
                    "customers",
                    sa.Column("id", sa.Integer, primary_key=True),
                    sa.Column("name", sa.String(50)),
                )

            def downgrade():
                op.drop_table("customers")
            """
        )
    )
    ini = folder / "alembic.ini"
    ini.write_text(
        textwrap.dedent(
            f"""
            [alembic]
            script_location = {folder}
            version_locations = {folder / "versions"} outbox:migrations/versions
            path_separator = space
            sqlalchemy.url = {url}
            """
        )
    )
    return ini


def test_an_application_alembic_environment_includes_the_outbox_branch(empty_url, tmp_path):
    from alembic import command
    from alembic.config import Config

    config = Config(str(write_app_alembic(tmp_path / "migrations", empty_url)))
    command.upgrade(config, "heads")
    assert database_objects(empty_url)[0] == OUTBOX_TABLES | {"customers"}

    # Autogenerate against the app's own models proposes nothing: the outbox tables are hidden.
    command.revision(config, message="check", autogenerate=True, rev_id="app_0002", head="app@head")
    generated = (tmp_path / "migrations" / "versions" / "app_0002_check.py").read_text()
    assert "outbox" not in generated.split('"""', 2)[-1], generated
    assert "op.drop_table" not in generated and "op.create_table" not in generated


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args], capture_output=True, text=True, timeout=120
    )


def test_outbox_migrate_command(empty_url):
    done = run_cli("migrate", "--database-url", empty_url)
    assert done.returncode == 0, done.stderr
    assert database_objects(empty_url)[0] == OUTBOX_TABLES
    again = run_cli("migrate", "--database-url", empty_url)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    ("url", "code"),
    [("nosuchdialect://x", 1), ("postgresql+psycopg://postgres@127.0.0.1:1/x", 1), ("not a url", 2)],
)
def test_outbox_migrate_refuses_bad_databases_in_one_line(url, code):
    done = run_cli("migrate", "--database-url", url)
    assert done.returncode == code
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 or done.stderr.strip().splitlines()[-1].startswith(
        "outbox: error:"
    ), done.stderr


def _schema_facts(url: str) -> dict[str, set[tuple[str, ...]]]:
    """What compare_metadata does not compare: index definitions (partial predicates included) and
    constraint definitions, as PostgreSQL itself prints them."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            indexes = conn.execute(
                text("SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'")
            )
            constraints = conn.execute(
                text(
                    "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint"
                    " WHERE connamespace = 'public'::regnamespace"
                )
            )
            return {
                "indexes": {tuple(r) for r in indexes if r[0] in OUTBOX_TABLES},
                "constraints": {tuple(r) for r in constraints if r[0] in OUTBOX_TABLES},
            }
    finally:
        engine.dispose()


def test_postgresql_indexes_and_constraints_match_the_definitions_exactly(pg_url, pg_base_url):
    """A database made from the table definitions equals a migrated one, predicate for predicate."""
    name = f"outbox_defs_{uuid.uuid4().hex[:12]}"
    admin = create_engine(pg_base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    from_definitions = make_url(pg_base_url).set(database=name).render_as_string(hide_password=False)
    try:
        engine = create_engine(from_definitions)
        combined = MetaData()
        for source in (outbox.metadata, report_metadata, email_metadata):
            for table in source.tables.values():
                table.to_metadata(combined)
        combined.create_all(engine)
        engine.dispose()
        migrated, defined = _schema_facts(pg_url), _schema_facts(from_definitions)
        # The one deliberate difference: on PostgreSQL outbox_attempt is partitioned by started_at
        # (outbox_0024), so its indexes are partitioned ones and its primary key includes started_at.
        partitioned = {
            (table, name, d.replace(" ON public.", " ON ONLY public.").replace("(id)", "(id, started_at)"))
            for table, name, d in defined["indexes"]
            if table == "outbox_attempt"
        }
        defined["indexes"] = {r for r in defined["indexes"] if r[0] != "outbox_attempt"} | partitioned
        defined["constraints"] = {
            (t, n, "PRIMARY KEY (id, started_at)" if n == "pk_outbox_attempt" else d)
            for t, n, d in defined["constraints"]
        }
        assert migrated["indexes"] == defined["indexes"]
        assert migrated["constraints"] == defined["constraints"]
        assert any("WHERE ((status)::text = 'pending'::text)" in r[2] for r in migrated["indexes"])
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_postgresql_triggers_cover_every_write_they_guard(pg_url):
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            triggers = dict(
                conn.execute(
                    text(
                        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
                        " WHERE NOT tgisinternal AND tgrelid::regclass::text LIKE 'outbox_%'"
                    )
                ).all()
            )
    finally:
        engine.dispose()
    notify = [d for d in triggers.values() if "outbox_notify" in d]
    assert notify and all(
        "AFTER INSERT ON public.outbox_message REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT" in d
        for d in notify
    )
    for guard in ("outbox_attempt_append_only", "outbox_inbox_kept", "outbox_inbox_dead_kept"):
        guarded = " ".join(d for d in triggers.values() if f"{guard}()" in d)
        for operation in ("UPDATE", "DELETE", "TRUNCATE"):
            assert operation in guarded, (guard, triggers)


def test_the_retried_now_outcome_keeps_sqlite_history_its_triggers_and_ids(tmp_path):
    """outbox_0009 rebuilds outbox_attempt on SQLite: rows, append-only triggers and ids survive."""
    url = f"sqlite:///{tmp_path / 'history.db'}"
    outbox.upgrade(url, "outbox_0008")
    engine = create_engine(url)
    insert_row = (
        "INSERT INTO outbox_attempt (id, message_id, attempt, outcome, started_at)"
        " VALUES (:id, 1, 1, :o, '2026-12-01')"
    )
    try:
        with engine.begin() as conn:
            for row_id, outcome in ((1, "failed"), (2, "delivered"), (10, "requeued")):
                conn.execute(text(insert_row), {"id": row_id, "o": outcome})
            before = conn.execute(text("SELECT * FROM outbox_attempt ORDER BY id")).all()
        with pytest.raises(Exception, match="CHECK constraint failed"), engine.begin() as conn:
            conn.execute(text(insert_row), {"id": None, "o": "retried_now"})

        assert outbox.upgrade(url, "outbox_0009") == ["outbox_0009"]
        with engine.begin() as conn:
            assert conn.execute(text("SELECT * FROM outbox_attempt ORDER BY id")).all() == before
            conn.execute(text(insert_row), {"id": None, "o": "retried_now"})
            assert conn.execute(text("SELECT max(id) FROM outbox_attempt")).scalar_one() == 11
        for statement, refusal in (
            ("UPDATE outbox_attempt SET outcome = 'dead'", "UPDATE is not allowed"),
            ("DELETE FROM outbox_attempt", "outbox_purge_in_progress"),  # refused before any row
            (
                "INSERT OR REPLACE INTO outbox_attempt (id, message_id, attempt, outcome, started_at)"
                " VALUES (1, 1, 1, 'dead', '2026-12-01')",
                "may not rewrite an existing row",
            ),
        ):
            with pytest.raises(Exception, match=refusal), engine.begin() as conn:
                conn.execute(text(statement))
        with engine.begin() as conn:  # outbox_0008's guard of the unique key survives too
            conn.execute(
                text(
                    "INSERT OR REPLACE INTO outbox_attempt (message_id, attempt, outcome, started_at)"
                    " VALUES (1, 1, 'delivered', '2026-12-01')"
                )
            )
            kept = conn.execute(text("SELECT * FROM outbox_attempt WHERE id <= 10 ORDER BY id")).all()
            assert kept == before
    finally:
        engine.dispose()
    with pytest.raises(RuntimeError, match="1 history row"):
        outbox._migrations.downgrade(url, "outbox_0008")


def test_the_pause_log_is_append_only_and_the_downgrade_keeps_it(empty_url):
    """outbox_0010: every pause and resume stays on record; nothing paused is resumed by a downgrade."""
    outbox.upgrade(empty_url)
    engine = create_engine(empty_url)
    now = "now()" if engine.dialect.name == "postgresql" else "'2026-12-08'"
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox_pause_log (event, kind, name, at, actor, reason)"
                    f" VALUES ('paused', 'queue', 'mail', {now}, 'ana', 'smtp migration')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO outbox_pause (kind, name, reason, actor, paused_at)"
                    f" VALUES ('queue', 'mail', 'smtp migration', 'ana', {now})"
                )
            )
        refusals = ["UPDATE outbox_pause_log SET actor = 'someone else'", "DELETE FROM outbox_pause_log"]
        if engine.dialect.name == "postgresql":
            refusals.append("TRUNCATE outbox_pause_log")
        for statement in refusals:
            with pytest.raises(Exception, match="outbox_pause_log is append-only"), engine.begin() as conn:
                conn.execute(text(statement))
        with pytest.raises(Exception, match="kind"), engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox_pause (kind, name, reason, actor, paused_at)"
                    f" VALUES ('route', 'x', 'r', 'a', {now})"
                )
            )
    finally:
        engine.dispose()
    with pytest.raises(RuntimeError, match="1 queue.* paused .* records 1 pause"):
        outbox._migrations.downgrade(empty_url, "outbox_0009")
