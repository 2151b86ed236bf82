"""The one sanctioned way to delete ``outbox_attempt`` rows (used by retention).

The database refuses UPDATE, DELETE and TRUNCATE on the history table; inside
this context manager, and only on its connection and transaction, DELETE is
allowed. UPDATE stays refused: history is never rewritten, only expired.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, text

from ._exceptions import ConfigurationError

__all__ = ["history_purge_allowed"]


@contextmanager
def history_purge_allowed(connection: Connection) -> Iterator[None]:
    dialect = connection.dialect.name
    if dialect == "postgresql":
        # SET LOCAL: the permission ends with the transaction, whatever happens.
        connection.execute(text("SET LOCAL outbox.retention = 'on'"))
        try:
            yield
        finally:
            connection.execute(text("SET LOCAL outbox.retention = 'off'"))
    elif dialect == "sqlite":
        raw = connection.connection.dbapi_connection
        assert raw is not None
        raw.create_function("outbox_purge_in_progress", 0, lambda: 1)
        try:
            yield
        finally:
            raw.create_function("outbox_purge_in_progress", 0, None)
    else:
        raise ConfigurationError(f"the outbox supports PostgreSQL and SQLite, not {dialect!r}")
