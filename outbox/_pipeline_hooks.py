"""Where a pipelined outbox INSERT's reply is read: hooks on every engine and pool, attached once.

They are attached by ``Outbox.install`` at start-up, on the ``Engine`` and
``Pool`` classes: adding a listener to an engine while other threads run its
events mutates the list they iterate ("deque mutated during iteration"). This
module imports nothing from psycopg, so applications on SQLite never load it;
while no INSERT is pending, each hook is one truth test. What the hooks do is
in ``_pipeline``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import Pool

__all__ = ["attach", "attached", "is_last_commit_listener", "pending"]

#: Pending INSERTs by ``id()`` of their psycopg connection (values: ``_pipeline._Pending``).
#: Each entry holds its connection, so the id cannot be reused while it exists;
#: every end of the transaction (commit, rollback, pool reset, checkin,
#: invalidation, close) removes it.
pending: dict[int, Any] = {}

#: Every way a DBAPI connection leaves a transaction without SQLAlchemy's rollback.
_POOL_EVENTS = ("reset", "checkin", "invalidate", "soft_invalidate", "close", "close_detached", "detach")

_attached = False


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
    if pending:
        from . import _pipeline

        _pipeline.before_statement(connection)


def _before_commit(connection: Connection) -> None:
    if pending:
        from . import _pipeline

        _pipeline.before_commit(connection)


def _before_rollback(connection: Connection) -> None:
    if pending:
        from . import _pipeline

        _pipeline.before_rollback(connection)


def _before_savepoint_rollback(connection: Connection, name: str, context: Any) -> None:
    # Only another thread's pending INSERT can be seen here: a pipelined INSERT
    # is never sent inside a savepoint.
    _before_rollback(connection)


def _leaving_pool(dbapi_connection: Any, *args: Any) -> None:
    if pending and dbapi_connection is not None:
        from . import _pipeline

        _pipeline.leaving_pool(dbapi_connection)
