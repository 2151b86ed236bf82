"""Where the inbox's SQL runs: the caller's Session or Connection, or a session it opens from a factory.

Sync and async are kept apart on purpose: ``receive()`` must run its INSERT
now and return the answer, which an ``AsyncSession`` can only do when
awaited, so each call has an ``a``-prefixed twin, and each refuses the other
kind of session with a message naming the twin. ``sqlalchemy.ext.asyncio``
is imported only by the async paths (it needs greenlet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker
    from sqlalchemy.orm import sessionmaker

__all__ = [
    "AsyncSessions",
    "Sessions",
    "async_connection_of",
    "connection_of",
    "open_async_session",
    "open_session",
]

#: Where ``process`` opens its transaction: a sessionmaker (with the Outbox installed, if handlers
#: emit), anything else that makes a Session, or an Engine (a plain Session, on which emit() is refused).
Sessions: TypeAlias = "sessionmaker[Session] | Callable[[], Session] | Engine"
AsyncSessions: TypeAlias = "async_sessionmaker[AsyncSession] | Callable[[], AsyncSession] | AsyncEngine"


def connection_of(session: Session | Connection | Any, what: str, bind: dict[str, Any]) -> Connection:
    """The connection of ``session``'s transaction (begun if it was not) for the table in ``bind``."""
    if isinstance(session, Session):
        return session.connection(bind_arguments=bind)
    if isinstance(session, Connection):
        return session
    if hasattr(session, "sync_session") or hasattr(session, "sync_connection"):
        raise TypeError(f"inbox.{what}() takes a Session; with an AsyncSession use await inbox.a{what}(...)")
    raise TypeError(f"inbox.{what}() takes a Session or a Connection, got {type(session).__name__}")


async def async_connection_of(
    session: AsyncSession | AsyncConnection | Any, what: str, bind: dict[str, Any]
) -> AsyncConnection:
    """:func:`connection_of` for an ``AsyncSession`` or ``AsyncConnection``."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(session, AsyncSession):
        return await session.connection(bind_arguments=bind)
    if isinstance(session, AsyncConnection):
        return session
    if isinstance(session, Session | Connection):
        raise TypeError(f"inbox.a{what}() takes an AsyncSession; with a Session use inbox.{what}(...)")
    raise TypeError(
        f"inbox.a{what}() takes an AsyncSession or an AsyncConnection, got {type(session).__name__}"
    )


def open_session(sessions: Sessions, what: str = "process") -> Session:
    """A new Session from ``sessions``; ``what`` names the inbox's call in a refusal."""
    if isinstance(sessions, Engine):
        return Session(sessions)
    if callable(sessions):
        made = sessions()
        if isinstance(made, Session):
            return made
        raise TypeError(
            f"inbox.{what}() needs Sessions, and its session factory made a {type(made).__name__}; "
            f"with AsyncSessions use await inbox.a{what}(...)"
        )
    raise TypeError(f"inbox.{what}() takes a sessionmaker or an Engine, got {type(sessions).__name__}")


def open_async_session(sessions: AsyncSessions, what: str = "process") -> AsyncSession:
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

    if isinstance(sessions, AsyncEngine):
        return AsyncSession(sessions)
    if callable(sessions):
        made = sessions()
        if isinstance(made, AsyncSession):
            return made
        raise TypeError(
            f"inbox.a{what}() needs AsyncSessions, and its session factory made a {type(made).__name__}; "
            f"with Sessions use inbox.{what}(...)"
        )
    raise TypeError(
        f"inbox.a{what}() takes an async_sessionmaker or an AsyncEngine, got {type(sessions).__name__}"
    )
