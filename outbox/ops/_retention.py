"""The one sanctioned way to delete ``outbox_attempt`` rows (used by retention).

The database refuses UPDATE, DELETE and TRUNCATE on the history table; inside
this context manager, and only on its connection and transaction, DELETE is
allowed. UPDATE stays refused: history is never rewritten, only expired.

On PostgreSQL the permission names the purge's ``outbox_retention_run`` row:
the trigger lets a DELETE through only while that row is unfinished, and only
for history older than the cutoff it records, so no deletion goes unrecorded.
Since migration ``outbox_0007`` it also must come from the tables' owner:
``outbox purge`` goes through the purge functions, which run as the owner and
set the permission themselves, so ``ops.purge`` uses this on SQLite only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, text

from .._exceptions import ConfigurationError

__all__ = ["history_purge_allowed"]


@contextmanager
def history_purge_allowed(connection: Connection, run_id: int) -> Iterator[None]:
    dialect = connection.dialect.name
    if dialect == "postgresql":
        # Local to the transaction: the permission ends with it, whatever happens.
        connection.execute(text("SELECT set_config('outbox.retention', :run, true)"), {"run": str(run_id)})
        try:
            yield
        finally:
            connection.execute(text("SELECT set_config('outbox.retention', '', true)"))
    elif dialect == "sqlite":
        raw = connection.connection.dbapi_connection
        assert raw is not None
        raw.create_function("outbox_purge_in_progress", 0, lambda: 1)
        try:
            yield
        finally:
            # Answering 0, not unregistered: Python's sqlite3 does not remove a function given
            # None, it registers one that raises, and the triggers' refusal would then read
            # "user-defined function raised exception" instead of saying what it refuses.
            raw.create_function("outbox_purge_in_progress", 0, lambda: 0)
    else:
        raise ConfigurationError(f"the outbox supports PostgreSQL and SQLite, not {dialect!r}")
