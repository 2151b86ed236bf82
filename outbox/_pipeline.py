"""The commit's outbox INSERT, sent in psycopg pipeline mode and answered with the COMMIT.

Without this, an emitting request waits for two replies in a row, the INSERT's
and then the COMMIT's, and PostgreSQL sits idle while SQLAlchemy runs its
commit machinery in between. In pipeline mode the INSERT is sent and executes
while that Python runs; the COMMIT follows in the same pipeline, and one wait
reads both replies. The benchmark's emit overhead fell from about 1.4 to about
1.2 (docs/performance.md).

Only the write made by the commit's own flush goes this way. By then the
application's code has run, so only SQLAlchemy can still touch the connection
before the COMMIT, and every way it can is hooked here:

- any statement (savepoints, other listeners' queries, ``PREPARE TRANSACTION``)
  first reads the pending replies, raising the INSERT's error as SQLAlchemy's
  own exception with the INSERT's text;
- the commit sends ``COMMIT`` into the pipeline and reads both replies, after
  which psycopg's own commit has nothing left to do;
- a rollback, of the transaction or of a savepoint, reads and discards them;
- a connection going back to the pool leaves pipeline mode first.

Flushes in the middle of a transaction still write the plain way, so an
application iterating a server-side cursor while it emits never meets a
connection in pipeline mode.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

__all__ = ["pipeline_connection", "send_in_pipeline"]

log = logging.getLogger("outbox.write")


@dataclass(slots=True)
class _Pending:
    raw: psycopg.Connection[Any]
    pipeline: Any  # the context manager psycopg's Connection.pipeline() returns, entered
    cursor: psycopg.Cursor[Any]
    statement: str


#: Pipelines sent and not yet answered, per DBAPI connection. Empty almost
#: always, so the per-statement hook costs one truth test on other connections.
_pending: weakref.WeakKeyDictionary[psycopg.Connection[Any], _Pending] = weakref.WeakKeyDictionary()
_hooked: weakref.WeakSet[Engine] = weakref.WeakSet()
_SUPPORTED = psycopg.Pipeline.is_supported()


def pipeline_connection(connection: Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection to pipeline on, or None where the plain INSERT must be used.

    Not for asyncio drivers (their pipeline is a coroutine API), autocommit
    connections (there is no COMMIT to ride with), a connection already in
    pipeline mode (the application's own pipeline), or a libpq older than 14,
    which has no pipeline mode.
    """
    raw: Any = connection.connection.dbapi_connection
    if type(raw) is not psycopg.Connection or raw.autocommit or not _SUPPORTED:
        return None
    if raw.pgconn.pipeline_status != pq.PipelineStatus.OFF or raw in _pending:
        return None
    return raw


def send_in_pipeline(
    connection: Connection, raw: psycopg.Connection[Any], statements: list[tuple[str, tuple[Any, ...]]]
) -> None:
    """Send the INSERTs without waiting; their replies are read by the hooks below."""
    _hook(connection.engine)
    pipeline = raw.pipeline()
    pipeline.__enter__()
    cursor = raw.cursor()
    try:
        for sql, params in statements:
            cursor.execute(sql, params)
    except BaseException:
        # Nothing is pending that the caller could still want: leave pipeline mode now.
        pipeline.__exit__(None, None, None)
        raise
    _pending[raw] = _Pending(raw, pipeline, cursor, statements[0][0])


def _root(engine: Engine) -> Engine:
    # engine.execution_options(...) makes an OptionEngine per call; hook the engine it
    # proxies (whose listeners it shares) so listeners do not pile up per call.
    proxied = getattr(engine, "_proxied", None)
    return _root(proxied) if isinstance(proxied, Engine) else engine


def _hook(engine: Engine) -> None:
    engine = _root(engine)
    if engine in _hooked:
        return
    event.listen(engine, "before_cursor_execute", _before_statement)
    event.listen(engine, "commit", _before_commit)
    event.listen(engine, "rollback", _before_rollback)
    event.listen(engine, "rollback_savepoint", _before_savepoint_rollback)
    event.listen(engine, "reset", _before_pool_reset)
    event.listen(engine, "checkin", _on_checkin)
    _hooked.add(engine)


def _take(raw: Any) -> _Pending | None:
    if not _pending or raw is None:
        return None
    return _pending.pop(raw, None)


def _read_replies(connection: Connection, pending: _Pending, *, commit: bool) -> None:
    """Read the pipeline's replies (after a COMMIT, if asked); raise failures as SQLAlchemy does."""
    try:
        if commit:
            pending.cursor.execute("COMMIT")
        pending.pipeline.__exit__(None, None, None)
    except psycopg.Error as exc:
        raw: Any = pending.raw
        invalidated = connection.dialect.is_disconnect(exc, raw, None)  # type: ignore[arg-type]
        if invalidated:
            connection.invalidate(exc)
        raise DBAPIError.instance(
            pending.statement,
            None,
            exc,
            psycopg.Error,
            hide_parameters=True,
            connection_invalidated=invalidated,
            dialect=connection.dialect,
        ) from exc


def _discard_replies(pending: _Pending) -> None:
    """Leave pipeline mode on the way to a rollback; what the INSERT said no longer matters."""
    try:
        pending.pipeline.__exit__(None, None, None)
    except psycopg.Error as exc:
        log.debug("outbox INSERT discarded by a rollback: %s", type(exc).__name__)


def _before_statement(connection: Connection, *args: Any) -> None:
    if _pending:
        pending = _take(connection.connection.dbapi_connection)
        if pending is not None:
            _read_replies(connection, pending, commit=False)


def _before_commit(connection: Connection) -> None:
    if _pending:
        pending = _take(connection.connection.dbapi_connection)
        if pending is not None:
            _read_replies(connection, pending, commit=True)


def _before_rollback(connection: Connection) -> None:
    if _pending:
        pending = _take(connection.connection.dbapi_connection)
        if pending is not None:
            _discard_replies(pending)


def _before_savepoint_rollback(connection: Connection, name: str, context: Any) -> None:
    # A pending INSERT was sent after the newest SAVEPOINT (that statement read
    # the replies before it), so rolling back to a savepoint undoes it anyway.
    _before_rollback(connection)


def _before_pool_reset(dbapi_connection: Any, record: Any, reset_state: Any = None) -> None:
    pending = _take(dbapi_connection)
    if pending is not None:
        _discard_replies(pending)


def _on_checkin(dbapi_connection: Any, record: Any) -> None:
    _before_pool_reset(dbapi_connection, record)
