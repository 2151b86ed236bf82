"""SQLite savepoints that keep the outbox's promise.

Python's sqlite3 driver (pysqlite, and aiosqlite on top of it) starts and ends
transactions on its own, around SQLAlchemy's back. That breaks SAVEPOINT: a
RELEASE of a savepoint that began the driver's implicit transaction commits it,
so an event emitted inside ``begin_nested()`` would be stored even when the
enclosing transaction then rolls back (and so would your own rows). SQLAlchemy's
SQLite documentation gives the cure: turn the driver's handling off and let
SQLAlchemy emit BEGIN itself. This applies that recipe to one engine.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ._exceptions import ConfigurationError

__all__ = ["enable_sqlite_savepoints"]


def _driver_hands_off(dbapi_connection: Any, connection_record: Any) -> None:
    dbapi_connection.isolation_level = None


def _begin_explicitly(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN")


def enable_sqlite_savepoints(engine: Any) -> Any:
    """Make ``Session.begin_nested()`` transactional on a SQLite engine; returns the engine.

    Takes an ``Engine`` or an ``AsyncEngine``. Call it right after
    ``create_engine()``, before the first connection is made. Calling it twice
    is harmless, and on any other database it does nothing, so an application
    that picks SQLite or PostgreSQL from its URL can call it unconditionally.
    """
    sync_engine = getattr(engine, "sync_engine", engine)
    if not isinstance(sync_engine, Engine):
        raise ConfigurationError(f"enable_sqlite_savepoints() takes an Engine or AsyncEngine, got {engine!r}")
    if sync_engine.dialect.name != "sqlite":
        return engine  # PostgreSQL's savepoints need no help
    if not event.contains(sync_engine, "connect", _driver_hands_off):
        event.listen(sync_engine, "connect", _driver_hands_off)
        event.listen(sync_engine, "begin", _begin_explicitly)
    return engine
