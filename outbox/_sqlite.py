"""SQLite savepoints that keep the outbox's promise.

Python's sqlite3 driver (pysqlite, and aiosqlite on top of it) starts and ends
transactions on its own, around SQLAlchemy's back. That breaks SAVEPOINT: a
RELEASE of a savepoint that began the driver's implicit transaction commits it,
so an event emitted inside ``begin_nested()`` would be stored even when the
enclosing transaction then rolls back (and so would your own rows). SQLAlchemy's
SQLite documentation gives the cure: turn the driver's handling off and let
SQLAlchemy emit BEGIN itself. This applies that recipe to one engine.

Emitting SQLAlchemy's BEGIN alone is not enough with concurrent writers: a
deferred transaction that read first and then writes must upgrade its lock,
and SQLite refuses that upgrade at once ("database is locked", no waiting)
when another writer is ahead. So transactions begin IMMEDIATE (they queue for
the write lock under the busy timeout instead), and file databases switch to
WAL so readers and the relay's polling never wait for a writer.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ._exceptions import ConfigurationError

__all__ = ["enable_sqlite_savepoints"]


class _Setup:
    """The per-connection settings; one instance per engine, so a second call keeps the first's."""

    def __init__(self, *, busy_timeout: float | None, wal: bool) -> None:
        self.busy_timeout = busy_timeout
        self.wal = wal

    def __call__(self, dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            if self.busy_timeout is not None:
                cursor.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            if self.wal:
                # Refused (and left as it is) for :memory: and some read-only or network files.
                cursor.execute("PRAGMA journal_mode = WAL")
        finally:
            cursor.close()


def _begin_explicitly(connection: Connection) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def enable_sqlite_savepoints(engine: Any, *, busy_timeout: float | None = 30.0, wal: bool = True) -> Any:
    """Make ``Session.begin_nested()`` transactional on a SQLite engine, safe for concurrent writers.

    Takes an ``Engine`` or an ``AsyncEngine`` and returns it. Call it right
    after ``create_engine()``, before the first connection is made. Calling it
    twice is harmless, and on any other database it does nothing, so an
    application that picks SQLite or PostgreSQL from its URL can call it
    unconditionally.

    ``busy_timeout`` (seconds, ``None`` keeps the driver's) is how long a
    transaction waits for another writer to finish; ``wal`` switches a file
    database to write-ahead logging, a lasting property of the file.
    """
    sync_engine = getattr(engine, "sync_engine", engine)
    if not isinstance(sync_engine, Engine):
        raise ConfigurationError(f"enable_sqlite_savepoints() takes an Engine or AsyncEngine, got {engine!r}")
    if sync_engine.dialect.name != "sqlite":
        return engine  # PostgreSQL's savepoints need no help
    if busy_timeout is not None and not (isinstance(busy_timeout, int | float) and busy_timeout >= 0):
        raise ConfigurationError(f"busy_timeout must be a number of seconds >= 0, got {busy_timeout!r}")
    if not event.contains(sync_engine, "begin", _begin_explicitly):
        event.listen(sync_engine, "connect", _Setup(busy_timeout=busy_timeout, wal=wal))
        event.listen(sync_engine, "begin", _begin_explicitly)
    return engine
