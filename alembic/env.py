"""Alembic environment for the ``outbox`` branch, used by ``outbox migrate``.

Applications that run their own Alembic environment do not use this file: they
add the branch's ``versions`` folder to their ``version_locations`` (see
docs/migrations.md).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from outbox._migrations import VERSION_TABLE, include_object
from outbox._tables import metadata


def _only_outbox(obj, name, type_, reflected, compare_to):  # type: ignore[no-untyped-def]
    """This environment manages the outbox tables and nothing else in the database."""
    return not include_object(obj, name, type_, reflected, compare_to)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        include_object=_only_outbox,
        transaction_per_migration=False,
        # Never the application's alembic_version: its history and ours must not collide.
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        literal_binds=True,
        version_table=VERSION_TABLE,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run outbox migrations through `outbox migrate` or outbox.upgrade()")
    _run(connection)
