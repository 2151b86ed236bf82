"""Where a pipelined outbox INSERT's reply is read: hooks on every engine and pool, attached once.

They are attached by ``Outbox.install`` at start-up, on the ``Engine`` and
``Pool`` classes: adding a listener to an engine while other threads run its
events mutates the list they iterate ("deque mutated during iteration"). This
module imports nothing from psycopg, so applications on SQLite never load it;
while no INSERT is pending, each hook is one truth test. What the hooks do is
in ``pipeline``, which hands its handlers over (:func:`use_reader`) as it loads:
an INSERT can only be pending once it has, so the hooks never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import Pool

__all__ = ["Reader", "attach", "attached", "is_last_commit_listener", "pending", "use_reader"]

#: Pending INSERTs by ``id()`` of their psycopg connection (values: ``pipeline._Pending``).
#: Each entry holds its connection, so the id cannot be reused while it exists;
#: every end of the transaction (commit, rollback, pool reset, checkin,
#: invalidation, close) removes it.
pending: dict[int, Any] = {}

#: Every way a DBAPI connection leaves a transaction without SQLAlchemy's rollback.
_POOL_EVENTS = ("reset", "checkin", "invalidate", "soft_invalidate", "close", "close_detached", "detach")

_attached = False


@dataclass(frozen=True, slots=True)
class Reader:
    """What reads or discards a pending reply, at each point SQLAlchemy can still touch the connection."""

    before_statement: Callable[[Connection], None]
    before_commit: Callable[[Connection], None]
    before_rollback: Callable[[Connection], None]
    leaving_pool: Callable[[Any], None]


#: Set by ``pipeline`` when it loads, which is before anything can be pending.
_reader: Reader | None = None


def use_reader(reader: Reader) -> None:
    global _reader
    _reader = reader


def attached() -> bool:
    return _attached


def attach() -> None:
    global _attached
    if _attached:
        return
    _attached = True
    event.listen(Engine, "before_cursor_execute", _before_statement)
    event.listen(Engine, "commit", _before_commit)
    event.listen(Engine, "rollback", _before_rollback)
    event.listen(Engine, "rollback_savepoint", _before_savepoint_rollback)
    for name in _POOL_EVENTS:
        event.listen(Pool, name, _leaving_pool)


def is_last_commit_listener(connection: Connection) -> bool:
    """No commit listener runs after ours, so none can veto a COMMIT already sent."""
    listeners = list(connection.dispatch.commit)
    return bool(listeners) and listeners[-1] is _before_commit


def _before_statement(connection: Connection, *args: Any) -> None:
    if pending and _reader is not None:
        _reader.before_statement(connection)


def _before_commit(connection: Connection) -> None:
    if pending and _reader is not None:
        _reader.before_commit(connection)


def _before_rollback(connection: Connection) -> None:
    if pending and _reader is not None:
        _reader.before_rollback(connection)


def _before_savepoint_rollback(connection: Connection, name: str, context: Any) -> None:
    # Only another thread's pending INSERT can be seen here: a pipelined INSERT
    # is never sent inside a savepoint.
    _before_rollback(connection)


def _leaving_pool(dbapi_connection: Any, *args: Any) -> None:
    if pending and dbapi_connection is not None and _reader is not None:
        _reader.leaving_pool(dbapi_connection)
