"""Programmatic access to the ``outbox`` Alembic branch shipped inside the package.

The scripts live in the top-level ``alembic/`` folder of the source tree and
install as ``outbox/migrations/`` in the wheel (the checkout has a symlink of the
same name), so ``outbox:migrations`` resolves in wheel and editable installs and
the installed package alone can migrate a database.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import URL, Connection, Engine, inspect, text
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    _Target = str | URL | Engine | AsyncEngine | Connection

from ._exceptions import ConfigurationError
from ._tables import metadata
from ._urls import sync_engine

__all__ = [
    "BRANCH",
    "OUTBOX_TABLES",
    "VERSION_TABLE",
    "downgrade",
    "include_name",
    "include_object",
    "is_history_partition",
    "missing_outbox_table",
    "script_location",
    "upgrade",
    "version_location",
]

BRANCH = "outbox"
#: Every table the ``outbox`` branch creates, including those of the integrations
#: (which ``outbox`` must not import, hence the names).
OUTBOX_TABLES = frozenset(metadata.tables) | {"outbox_report_run", "outbox_report_chunk", "outbox_email_sent"}
#: Where ``outbox migrate`` records the branch's revision. An application's own
#: ``alembic_version`` is never read or written by it (except once, to adopt a
#: database migrated before this table existed): the two histories cannot collide.
VERSION_TABLE = "outbox_alembic_version"
_LEGACY_VERSION_TABLE = "alembic_version"
_HIDDEN = OUTBOX_TABLES | {VERSION_TABLE}
#: On PostgreSQL ``outbox_attempt`` lives in daily partitions (migration outbox_0024), tables of
#: their own that the branch creates and the purge drops.
_HISTORY_PARTITION = re.compile(r"outbox_attempt_(p[0-9]{8}|default)")


def is_history_partition(name: str | None) -> bool:
    """True for a partition of ``outbox_attempt`` (``outbox_attempt_pYYYYMMDD``, ``..._default``)."""
    return name is not None and _HISTORY_PARTITION.fullmatch(name) is not None


def _hidden(name: str | None) -> bool:
    return name in _HIDDEN or is_history_partition(name)


def script_location() -> Path:
    return Path(__file__).resolve().parent / "migrations"


def version_location() -> Path:
    """The folder to add to an application's ``version_locations``."""
    return script_location() / "versions"


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """An ``include_object`` hook for an application's own autogenerate.

    It hides the outbox's tables (and their indexes and constraints) so that
    autogenerate neither proposes to drop them nor to alter them; the ``outbox``
    branch owns them.
    """
    if type_ == "table":
        return not _hidden(name)
    table = getattr(obj, "table", None)
    return not _hidden(getattr(table, "name", None))


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """An ``include_name`` hook: autogenerate does not even reflect the outbox's tables.

    Cheaper than :func:`include_object` on large schemas, and it also hides
    ``outbox_alembic_version``, the version table of ``outbox migrate``.
    """
    if type_ == "table":
        return not _hidden(name)
    return True


def _config(connection: Connection) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["connection"] = connection
    return config


def _revisions(connection: Connection) -> set[str]:
    """Revisions of the ``outbox`` branch recorded in ``outbox_alembic_version`` (none: not migrated)."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return set()
    return {r for (r,) in connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))}


def _adopt_legacy_version(connection: Connection) -> None:
    """Move the revision an earlier ``outbox migrate`` wrote into ``alembic_version`` to our own table.

    Adopted only when ``alembic_version`` holds nothing but outbox revisions
    (then ``outbox migrate`` created it, and it is dropped). If it also holds an
    application's revisions, the outbox tables are a branch of that
    application's Alembic environment, and that environment keeps them.
    """
    found = inspect(connection)
    if found.has_table(VERSION_TABLE) or not found.has_table(_LEGACY_VERSION_TABLE):
        return
    recorded = [r for (r,) in connection.execute(text(f"SELECT version_num FROM {_LEGACY_VERSION_TABLE}"))]
    ours = [r for r in recorded if r.startswith(f"{BRANCH}_")]
    if not ours:
        return
    if len(ours) != len(recorded):
        raise ConfigurationError(
            "the outbox tables here are a branch of your application's Alembic environment "
            f"(revision {', '.join(sorted(ours))} in alembic_version): migrate them with "
            "`alembic upgrade heads`, not `outbox migrate` (see docs/migrations.md)"
        )
    connection.execute(
        text(
            f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
            f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
        )
    )
    for revision in ours:
        connection.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:r)"), {"r": revision})
    connection.execute(text(f"DROP TABLE {_LEGACY_VERSION_TABLE}"))


def _run(target: _Target, action: Any) -> tuple[set[str], set[str]]:
    """Run an Alembic command on the branch; returns the revisions recorded before and after."""

    def on(connection: Connection) -> tuple[set[str], set[str]]:
        _adopt_legacy_version(connection)
        before = _revisions(connection)
        action(_config(connection))
        return before, _revisions(connection)

    if isinstance(target, Connection):
        return on(target)
    engine = sync_engine(target, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            return on(connection)
    finally:
        if engine is not target:
            engine.dispose()


def upgrade(target: _Target, revision: str = f"{BRANCH}@head") -> list[str]:
    """Create or upgrade the outbox tables (a database URL, an Engine, an AsyncEngine or a Connection).

    An async URL or AsyncEngine is migrated through the matching synchronous
    driver (``postgresql+psycopg`` or ``sqlite``), with the same connection settings.

    Returns the revisions applied, oldest first (empty when already there).
    """
    from alembic import command

    before, after = _run(target, lambda config: command.upgrade(config, revision))
    return _between(before, after)


def downgrade(target: _Target, revision: str = f"{BRANCH}@base") -> None:
    """Undo outbox migrations down to ``revision`` (by default: drop the outbox tables)."""
    from alembic import command

    _run(target, lambda config: command.downgrade(config, revision))


def _between(before: set[str], after: set[str]) -> list[str]:
    """The branch's revisions after ``before`` up to and including ``after`` (it is linear)."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(script_location()))
    scripts = ScriptDirectory.from_config(config)
    walked: list[str] = []
    for head in after:
        for script in scripts.iterate_revisions(head, "base"):
            if script.revision in before:
                break
            walked.append(script.revision)
    return walked[::-1]


def missing_outbox_table(error: BaseException) -> str | None:
    """The outbox table a database error says does not exist (not migrated, or not this far), or None.

    ``outbox`` and ``outbox-relay`` turn it into one line that says to run ``outbox migrate``.
    """
    orig = getattr(error, "orig", None) or error
    said = str(orig)
    undefined = (
        getattr(orig, "sqlstate", None) == "42P01"  # psycopg, asyncpg
        or getattr(orig, "pgcode", None) == "42P01"  # psycopg2
        or type(orig).__name__ == "UndefinedTable"
        or "no such table" in said  # SQLite
    )
    if not undefined:
        return None
    for name in sorted(OUTBOX_TABLES, key=len, reverse=True):  # outbox_pause_log before outbox_pause
        if name in said:
            return name
    return None
