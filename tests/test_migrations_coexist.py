"""The outbox's migrations beside an application's own Alembic history, through the real command lines.

Both documented recipes, each from ``alembic init`` on: the application's own
first revision, upgrade, an autogenerate check that sees no outbox difference,
and a downgrade of the application alone that leaves the outbox untouched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.orm import sessionmaker
from test_migrations import OUTBOX_TABLES

import outbox

APP_MODELS = """
from sqlalchemy import Column, Integer, MetaData, String, Table

metadata = MetaData()
customers = Table("customers", metadata, Column("id", Integer, primary_key=True), Column("name", String(50)))
"""


def sh(folder: Path, *args: str) -> str:
    done = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def alembic(folder: Path, *args: str) -> str:
    return sh(folder, sys.executable, "-m", "alembic", *args)


def outbox_cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args], cwd=folder, capture_output=True, text=True, timeout=120
    )


def init_app(folder: Path, url: str, *, hook: str) -> None:
    """``alembic init``, then the edits docs/migrations.md asks for, made to the generated files."""
    folder.mkdir()
    alembic(folder, "init", "migrations")
    (folder / "app_models.py").write_text(APP_MODELS)
    ini = folder / "alembic.ini"
    ini.write_text(ini.read_text().replace("driver://user:pass@localhost/dbname", url))
    env = folder / "migrations" / "env.py"
    source = env.read_text()
    assert source.count("target_metadata=target_metadata") == 2
    source = source.replace(
        "target_metadata = None",
        "import sys\nsys.path.insert(0, str(__import__('pathlib').Path(__file__).parents[1]))\n"
        "import outbox\nfrom app_models import metadata as target_metadata",
    ).replace("target_metadata=target_metadata", f"target_metadata=target_metadata, {hook}")
    env.write_text(source)


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def versions(url: str, table: str) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {r for (r,) in conn.execute(text(f"SELECT version_num FROM {table}"))}
    finally:
        engine.dispose()


def head() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(outbox._migrations.script_location()))
    (only,) = ScriptDirectory.from_config(config).get_heads()
    return only


def test_outbox_migrate_keeps_its_own_version_table_beside_the_apps_alembic(empty_url, tmp_path):
    app = tmp_path / "app"
    init_app(app, empty_url, hook="include_name=outbox.include_name")

    # The outbox first: the app's first autogenerate must not propose to drop its tables.
    migrated = outbox_cli(app, "migrate", "--database-url", empty_url)
    assert migrated.returncode == 0, migrated.stderr
    assert "applied outbox_0001" in migrated.stdout
    alembic(app, "revision", "--autogenerate", "-m", "customers")
    (generated,) = (app / "migrations" / "versions").glob("*_customers.py")
    body = generated.read_text()
    assert "op.create_table('customers'" in body or 'op.create_table("customers"' in body
    assert "outbox" not in body and "drop_table" not in body.split("def downgrade")[0]
    alembic(app, "upgrade", "head")
    assert "No new upgrade operations detected" in alembic(app, "check")
    assert tables(empty_url) >= OUTBOX_TABLES | {"customers", "alembic_version", outbox.VERSION_TABLE}
    assert versions(empty_url, outbox.VERSION_TABLE) == {head()}
    assert not any(v.startswith("outbox") for v in versions(empty_url, "alembic_version"))

    # Either history moves on without the other noticing.
    again = outbox_cli(app, "migrate", "--database-url", empty_url)
    assert again.returncode == 0 and "nothing to apply" in again.stdout, again.stdout + again.stderr
    alembic(app, "upgrade", "head")
    alembic(app, "downgrade", "base")
    assert "customers" not in tables(empty_url)
    assert tables(empty_url) >= OUTBOX_TABLES
    assert versions(empty_url, outbox.VERSION_TABLE) == {head()}


def test_the_outbox_as_a_branch_of_the_apps_alembic_environment(empty_url, tmp_path):
    app = tmp_path / "app"
    init_app(app, empty_url, hook="include_object=outbox.include_object")
    ini = app / "alembic.ini"
    # The documented edits: the outbox's versions beside the app's, separated by spaces.
    source = ini.read_text()
    assert "path_separator = os" in source
    ini.write_text(
        source.replace("path_separator = os", "path_separator = space").replace(
            "# version_locations = %(here)s/bar:%(here)s/bat:%(here)s/alembic/versions",
            "version_locations = %(here)s/migrations/versions outbox:migrations/versions",
        )
    )
    # Autogenerate needs every head applied: the outbox branch first, then the app's first
    # revision starts a branch of its own.
    alembic(app, "upgrade", "heads")
    alembic(
        app,
        "revision",
        "--autogenerate",
        "-m",
        "customers",
        "--head",
        "base",
        "--branch-label",
        "app",
        "--version-path",
        "migrations/versions",
    )
    alembic(app, "upgrade", "heads")
    assert tables(empty_url) >= OUTBOX_TABLES | {"customers"}
    assert outbox.VERSION_TABLE not in tables(empty_url)
    assert "No new upgrade operations detected" in alembic(app, "check")
    alembic(app, "downgrade", "app@base")
    assert "customers" not in tables(empty_url)
    assert tables(empty_url) >= OUTBOX_TABLES
    assert versions(empty_url, "alembic_version") == {head()}

    # `outbox migrate` will not take the branch away from the app's environment.
    alembic(app, "upgrade", "app@head")
    refused = outbox_cli(app, "migrate", "--database-url", empty_url)
    assert refused.returncode == 1
    assert "alembic upgrade heads" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_outbox_migrate_adopts_a_database_migrated_into_alembic_version(empty_url, tmp_path):
    """Databases migrated before ``outbox_alembic_version`` existed keep their data and move on."""
    outbox.upgrade(empty_url, "outbox_0005")
    engine = create_engine(empty_url)
    try:
        with engine.begin() as conn:
            # What an earlier `outbox migrate` left: the branch recorded in alembic_version.
            conn.execute(text(f"ALTER TABLE {outbox.VERSION_TABLE} RENAME TO alembic_version"))
            if engine.dialect.name == "postgresql":
                conn.execute(
                    text(
                        f"ALTER TABLE alembic_version RENAME CONSTRAINT {outbox.VERSION_TABLE}_pkc"
                        " TO alembic_version_pkc"
                    )
                )
        ob = outbox.Outbox()
        ob.route("kept.event", lambda message: None, name="kept")
        ob.install(sessions := sessionmaker(engine))
        with sessions.begin() as session:
            outbox.emit(session, "kept.event", {"n": 1})
    finally:
        engine.dispose()

    migrated = outbox_cli(tmp_path, "migrate", "--database-url", empty_url)
    assert migrated.returncode == 0, migrated.stderr
    assert "applied outbox_0006" in migrated.stdout
    assert "alembic_version" not in tables(empty_url)
    assert versions(empty_url, outbox.VERSION_TABLE) == {head()}
    engine = create_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(outbox.outbox_message.c.event_type)).scalars().all() == ["kept.event"]
    finally:
        engine.dispose()


@pytest.mark.parametrize("revision", ["outbox@head", "outbox_0001"])
def test_outbox_migrate_says_what_it_applied(empty_url, tmp_path, revision):
    first = outbox_cli(tmp_path, "migrate", "--database-url", empty_url, "--revision", revision)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("outbox migrate: applied outbox_0001")
    second = outbox_cli(tmp_path, "migrate", "--database-url", empty_url, "--revision", revision)
    assert "nothing to apply" in second.stdout


# -- an application with a history of its own ------------------------------------------------------------

MORE_MODELS = """
orders = Table("orders", metadata, Column("id", Integer, primary_key=True))
"""
EVEN_MORE_MODELS = """
invoices = Table("invoices", metadata, Column("id", Integer, primary_key=True))
refunds = Table("refunds", metadata, Column("id", Integer, primary_key=True))
"""
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "migrations.md"


def alembic_fails(folder: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "alembic", *args], cwd=folder, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0, f"{args} should have failed: {done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def add_models(app: Path, source: str) -> None:
    models = app / "app_models.py"
    models.write_text(models.read_text() + source)


def revision_file(app: Path, message: str) -> Path:
    (found,) = (app / "migrations" / "versions").glob(f"*_{message}.py")
    return found


def emit_one(url: str) -> None:
    engine = create_engine(url)
    try:
        ob = outbox.Outbox()
        ob.route("kept.event", lambda message: None, name="kept")
        ob.install(sessions := sessionmaker(engine))
        with sessions.begin() as session:
            outbox.emit(session, "kept.event", {"n": 1})
        ob.uninstall(sessions)
    finally:
        engine.dispose()


def test_the_branch_recipe_for_an_application_with_revisions_of_its_own(empty_url, tmp_path):
    guide = GUIDE.read_text()
    app = tmp_path / "app"
    init_app(app, empty_url, hook="include_object=outbox.include_object")
    # Two revisions of the application's own, with no branch label: the history the recipe meets.
    alembic(app, "revision", "--autogenerate", "-m", "customers")
    add_models(app, MORE_MODELS)
    alembic(app, "upgrade", "head")
    alembic(app, "revision", "--autogenerate", "-m", "orders")
    alembic(app, "upgrade", "head")
    first = revision_file(app, "customers").name.split("_")[0]
    second = revision_file(app, "orders").name.split("_")[0]
    assert versions(empty_url, "alembic_version") == {second}

    # The guide's edits to alembic.ini.
    assert "version_locations = %(here)s/migrations/versions outbox:migrations/versions" in guide
    ini = app / "alembic.ini"
    ini.write_text(
        ini.read_text()
        .replace("path_separator = os", "path_separator = space")
        .replace(
            "# version_locations = %(here)s/bar:%(here)s/bat:%(here)s/alembic/versions",
            "version_locations = %(here)s/migrations/versions outbox:migrations/versions",
        )
    )
    heads = alembic(app, "heads")
    assert f"{second} (head)" in heads and f"{head()} (outbox) (head)" in heads
    refused = alembic_fails(app, "upgrade", "head")
    assert "Multiple head revisions are present for given argument 'head'" in refused
    assert "Multiple head revisions are present for given argument 'head'" in guide.replace("\n", " ")
    assert "alembic upgrade heads" in guide
    alembic(app, "upgrade", "heads")
    assert tables(empty_url) >= OUTBOX_TABLES | {"customers", "orders"}
    assert versions(empty_url, "alembic_version") == {second, head()}
    assert "No new upgrade operations detected" in alembic(app, "check")

    # A new revision: refused without a head, then after the revision's own branch by id ...
    add_models(app, EVEN_MORE_MODELS.splitlines()[1] + "\n")
    alembic_fails(app, "revision", "--autogenerate", "-m", "invoices")
    assert "Can't locate revision identified by 'app'" in alembic_fails(
        app, "revision", "--autogenerate", "-m", "invoices", "--head", "app@head"
    )
    assert "--head 1975ea83b712@head" in guide
    alembic(app, "revision", "--autogenerate", "-m", "invoices", "--head", f"{first}@head")
    alembic(app, "upgrade", "heads")
    # ... then by the label the guide says to add to the first revision.
    base = revision_file(app, "customers")
    source = base.read_text()
    assert source.count("branch_labels: Union[str, Sequence[str], None] = None") == 1
    assert 'branch_labels = ("app",)' in guide
    base.write_text(source.replace("= None\ndepends_on", '= ("app",)\ndepends_on'))
    add_models(app, EVEN_MORE_MODELS.splitlines()[2] + "\n")
    alembic(app, "revision", "--autogenerate", "-m", "refunds", "--head", "app@head")
    alembic(app, "upgrade", "heads")
    fourth = revision_file(app, "refunds").name.split("_")[0]
    assert versions(empty_url, "alembic_version") == {fourth, head()}
    assert tables(empty_url) >= OUTBOX_TABLES | {"customers", "orders", "invoices", "refunds"}
    assert "outbox" not in revision_file(app, "refunds").read_text().split("def downgrade")[0]

    # Down the application's branch alone, by label or by a revision of it.
    alembic(app, "downgrade", "app@base")
    assert versions(empty_url, "alembic_version") == {head()}
    assert not tables(empty_url) & {"customers", "orders", "invoices", "refunds"}
    alembic(app, "upgrade", "heads")

    # `alembic downgrade base` takes the outbox's tables and their history with it, unasked ...
    emit_one(empty_url)
    alembic(app, "downgrade", "base")
    assert not tables(empty_url) & (OUTBOX_TABLES | {"customers"})
    assert versions(empty_url, "alembic_version") == set()

    # ... unless a record the outbox keeps would go: it refuses, and what is left depends on the database.
    alembic(app, "upgrade", "heads")
    engine = create_engine(empty_url)
    try:
        outbox.ops.pause(engine, queue="mail", reason="maintenance", actor="tests")
    finally:
        engine.dispose()
    refusal = alembic_fails(app, "downgrade", "base")
    assert "RuntimeError: cannot downgrade below outbox_0010" in refusal
    if empty_url.startswith("postgresql"):  # one transaction: nothing changed
        assert versions(empty_url, "alembic_version") == {fourth, head()}
        assert tables(empty_url) >= OUTBOX_TABLES | {"customers", "refunds"}
    else:  # what ran before the refusal stays done
        assert versions(empty_url, "alembic_version") == {"outbox_0010"}
        assert not tables(empty_url) & {"customers", "refunds", "outbox_breaker", "outbox_relay_registry"}
        assert tables(empty_url) >= {"outbox_message", "outbox_attempt", "outbox_pause", "outbox_pause_log"}
