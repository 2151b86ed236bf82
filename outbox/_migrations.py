"""Programmatic access to the ``outbox`` Alembic branch shipped inside the package.

The scripts live in the top-level ``alembic/`` folder of the source tree and
install as ``outbox/migrations/`` in the wheel (the checkout has a symlink of the
same name), so ``outbox:migrations`` resolves in wheel and editable installs and
the installed package alone can migrate a database.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.pool import NullPool

from ._tables import metadata

__all__ = [
    "BRANCH",
    "OUTBOX_TABLES",
    "downgrade",
    "include_object",
    "script_location",
    "upgrade",
    "version_location",
]

BRANCH = "outbox"
#: Every table the ``outbox`` branch creates, including those of the integrations
#: (which ``outbox`` must not import, hence the names).
OUTBOX_TABLES = frozenset(metadata.tables) | {"outbox_report_run", "outbox_report_chunk", "outbox_email_sent"}


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
        return name not in OUTBOX_TABLES
    table = getattr(obj, "table", None)
    return getattr(table, "name", None) not in OUTBOX_TABLES


def _config(connection: Connection) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["connection"] = connection
    return config


def _run(target: str | Engine | Connection, action: Any) -> None:
    if isinstance(target, Connection):
        action(_config(target))
        return
    engine = create_engine(target, poolclass=NullPool) if isinstance(target, str) else target
    try:
        with engine.begin() as connection:
            action(_config(connection))
    finally:
        if isinstance(target, str):
            engine.dispose()


def upgrade(target: str | Engine | Connection, revision: str = f"{BRANCH}@head") -> None:
    """Create or upgrade the outbox tables (a database URL, an Engine or a Connection)."""
    from alembic import command

    _run(target, lambda config: command.upgrade(config, revision))


def downgrade(target: str | Engine | Connection, revision: str = f"{BRANCH}@base") -> None:
    """Undo outbox migrations down to ``revision`` (by default: drop the outbox tables)."""
    from alembic import command

    _run(target, lambda config: command.downgrade(config, revision))
