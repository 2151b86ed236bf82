"""What the testing helpers read through: a bind of any kind, and the transaction it may hold.

A test holds one of many things: an Engine or AsyncEngine, a URL (sync or
async), a Session or AsyncSession, a Connection or AsyncConnection. The helpers
that read committed rows open a connection of their own to the same database,
through ``outbox._urls`` as the relay does (an async driver becomes its
synchronous twin, with the same connection settings). :func:`read_messages`
reads through the bind itself instead, inside whatever transaction it holds,
which is how a test that never commits sees what it emitted.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy import select
from sqlalchemy.engine import URL, Connection, Engine, Row
from sqlalchemy.orm import Session

from .._exceptions import ConfigurationError
from .._tables import outbox_message
from .._urls import engine_of, sync_engine
from .._write.install import write_owed

if TYPE_CHECKING:
    import uuid

    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    Bind: TypeAlias = Engine | AsyncEngine | Connection | AsyncConnection | Session | AsyncSession | str | URL

__all__ = ["committed", "is_async_transaction", "read_messages", "read_messages_async"]

_KINDS = "an Engine, an AsyncEngine, a Connection, an AsyncConnection, a Session, an AsyncSession or a URL"
#: Event ids per SELECT: far below every driver's parameter limit.
_CHUNK = 500


@contextmanager
def committed(bind: Bind) -> Iterator[Connection]:
    """A connection of its own to ``bind``'s database: it sees what has been committed, nothing else."""
    engine = engine_of(bind)
    if not isinstance(engine, Engine | str | URL) and not hasattr(engine, "sync_engine"):
        raise ConfigurationError(f"expected {_KINDS}, got {type(bind).__name__}")
    sync = sync_engine(engine)
    try:
        with sync.connect() as conn:
            yield conn
    finally:
        if sync is not engine:
            sync.dispose()


def is_async_transaction(bind: object) -> bool:
    """An AsyncSession or AsyncConnection: readable only from a coroutine."""
    return hasattr(bind, "sync_session") or hasattr(bind, "sync_connection")


def _select(executor: Session | Connection, event_ids: Sequence[uuid.UUID]) -> list[Row[Any]]:
    rows: list[Row[Any]] = []
    for start in range(0, len(event_ids), _CHUNK):
        chunk = event_ids[start : start + _CHUNK]
        rows.extend(executor.execute(select(outbox_message).where(outbox_message.c.event_id.in_(chunk))))
    return sorted(rows, key=lambda row: row.id)


def _through(executor: Session | Connection, event_ids: Sequence[uuid.UUID]) -> list[Row[Any]]:
    if isinstance(executor, Session):
        # What the commit would write, written now, so a test that never commits sees it.
        write_owed(executor)
        return _select(executor, event_ids)
    began = not executor.in_transaction()
    try:
        return _select(executor, event_ids)
    finally:
        if began:  # leave the test's connection as it was: no transaction of ours left open
            executor.rollback()


def read_messages(bind: Bind, event_ids: Sequence[uuid.UUID]) -> list[Row[Any]]:
    """The ``outbox_message`` rows of ``event_ids`` that ``bind`` sees, oldest first.

    A session or connection is read inside its own transaction (a session's
    emitted events are written first); anything else through a connection of
    its own. An AsyncSession or AsyncConnection needs :func:`read_messages_async`.
    """
    if not event_ids:
        return []
    if is_async_transaction(bind):
        raise RuntimeError(f"an {type(bind).__name__} is read from a coroutine: use read_messages_async")
    if isinstance(bind, Session | Connection):
        return _through(bind, event_ids)
    with committed(bind) as conn:
        return _select(conn, event_ids)


async def read_messages_async(bind: Bind, event_ids: Sequence[uuid.UUID]) -> list[Row[Any]]:
    """:func:`read_messages` for any bind, an AsyncSession or AsyncConnection included."""
    if not event_ids:
        return []
    run_sync = getattr(bind, "run_sync", None)
    if is_async_transaction(bind) and run_sync is not None:
        rows: list[Row[Any]] = await run_sync(_through, event_ids)
        return rows
    return read_messages(bind, event_ids)
