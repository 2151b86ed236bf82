"""The commit's outbox INSERT, sent in psycopg pipeline mode and answered with the COMMIT.

Without this, an emitting request waits for two replies in a row, the INSERT's
and then the COMMIT's, and PostgreSQL sits idle while SQLAlchemy runs its
commit machinery in between. In pipeline mode the INSERT is sent and executes
while that Python runs; the COMMIT follows in the same pipeline, and one wait
reads both replies. The benchmark's emit overhead fell from about 1.4 to about
1.2 (bench/RESULTS.md, "Emit").

Such a commit goes through psycopg's ``Pipeline`` until psycopg has prepared
the INSERT on the connection (as it prepares any statement, after
``prepare_threshold`` runs); later ones send that prepared statement straight
through libpq (``direct_pipeline``), which costs the request far less CPU.
Both are read and handled alike below.

A pending reply is a hazard for anything else that uses the connection: an
error read by someone else's statement could be swallowed, after which the
COMMIT would quietly turn into a ROLLBACK. So the caller (``install``) only
pipelines when nothing but SQLAlchemy itself can run between the INSERT and the
COMMIT: the root transaction's commit, on a connection the session began and
will commit itself, sent once no flush or lifecycle listener can run any more
(from the Outbox's ``after_flush`` if it is the last to run, else after the
flush), with no ``before_commit`` listener after the Outbox's. Within that,
every way SQLAlchemy can still touch the connection is hooked
(``pipeline_hooks``) and handled here:

- a statement first reads the pending reply; an error is raised there as
  SQLAlchemy's own exception, and raised again by the commit, which cannot
  succeed after it;
- the commit sends ``COMMIT`` into the pipeline (unless an engine ``commit``
  listener comes after ours and might still veto) and reads both replies; a
  failure is raised through SQLAlchemy's error handling (``handle_error``
  listeners, disconnect detection), naming the statement that failed, and an
  aborted transaction is rolled back first so the connection stays usable;
- once the server has answered the COMMIT with COMMIT, the transaction is
  committed whatever happens next: a connection lost before the rest of the
  replies (PostgreSQL sends the COMMIT's answer, then exits when its backend is
  terminated) is a closed connection, not a failed commit, so ``commit()``
  returns and the connection is discarded (``_retire``). Only a COMMIT whose
  answer never arrives is reported as a failure whose outcome is unknown;
- an interruption while waiting (a timeout, KeyboardInterrupt) cancels the
  server's work and invalidates the connection: whether it committed is then
  unknown, as with any COMMIT cut short;
- a rollback, a pool reset, checkin, invalidation or close discards what is
  pending; nothing ever goes back to the pool in pipeline mode.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg
from psycopg import pq
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, StatementError

from .._first_line import first_line
from . import pipeline_hooks as _hooks
from .direct_pipeline import DirectBatch, prepared_statement

if TYPE_CHECKING:
    from .dedupe import Settle

__all__ = [
    "before_commit",
    "before_rollback",
    "before_statement",
    "leaving_pool",
    "pipeline_connection",
    "send_in_pipeline",
]

log = logging.getLogger("outbox.write")

_SUPPORTED = psycopg.Pipeline.is_supported()
_SETTLED = (pq.TransactionStatus.IDLE, pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


class _CommitReply:
    """Where psycopg's pipeline hands the COMMIT's replies, in the place it keeps for a cursor.

    psycopg checks a statement's replies and gives them to its cursor
    (``_check_results``, ``_set_results``); these do the same for the one
    thing wanted here: did the server say COMMIT?
    """

    __slots__ = ("_encoding", "committed")

    def __init__(self, encoding: str) -> None:
        self._encoding = encoding
        self.committed = False

    def _check_results(self, results: list[pq.abc.PGresult]) -> None:
        # A COMMIT skipped because the INSERT failed ("pipeline aborted") raises
        # nothing: psycopg raises the INSERT's own error, which this must not replace.
        for result in results:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise psycopg.errors.error_from_result(result, encoding=self._encoding)

    def _set_results(self, results: list[pq.abc.PGresult]) -> None:
        self.committed = any(
            # (A COMMIT in a failed transaction answers ROLLBACK.)
            result.status == pq.ExecStatus.COMMAND_OK and result.command_status == b"COMMIT"
            for result in results
        )


class _PsycopgBatch:
    """The INSERT sent through psycopg's ``Pipeline``: until psycopg has prepared it on this connection."""

    __slots__ = ("_raw", "_context", "_pipeline", "_cursor", "_commit", "_exited")

    def __init__(self, raw: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]) -> None:
        self._raw = raw
        self._commit: _CommitReply | psycopg.Cursor[Any] | None = None
        self._exited = False
        self._context: Any = raw.pipeline()  # the context manager, entered by hand
        self._pipeline: psycopg.Pipeline = self._context.__enter__()
        try:
            self._cursor = raw.cursor()
            # psycopg prepares it as it does any statement (after prepare_threshold
            # runs). Asking for it sooner would cost a DEALLOCATE ALL at the next
            # rollback on this connection, which a read-only request's pool reset is.
            self._cursor.execute(sql, params)
        except BaseException:
            # Nothing is pending that anyone could still want: leave pipeline mode now.
            self._exited = True
            self._context.__exit__(*sys.exc_info())
            raise

    @property
    def inserted(self) -> bool:
        return (self._cursor.statusmessage or "").startswith("INSERT")

    def stored_count(self) -> int:
        return max(self._cursor.rowcount, 0) if self._cursor.description is not None else 0

    def stored_pairs(self) -> list[tuple[Any, Any]]:
        return [tuple(row) for row in self._cursor.fetchall()] if self._cursor.description is not None else []

    @property
    def committed(self) -> bool:
        """The server's reply to the COMMIT has been read and says it committed."""
        commit = self._commit
        if isinstance(commit, _CommitReply):
            return commit.committed
        # (A COMMIT in a failed transaction answers ROLLBACK.)
        return commit is not None and commit.statusmessage == "COMMIT"

    def send_commit(self) -> None:
        """Queue the COMMIT so that it goes out with the Sync ``finish`` sends, in one exchange.

        ``cursor.execute`` would send it at once, and its reply could then be
        read while psycopg sends the Sync: psycopg drops the replies it has
        read in an exchange that fails later, so a connection lost at that
        moment would also lose the news that the COMMIT succeeded. Queued
        here, its reply is read only once nothing is left to send, and is
        handed over before anything else can fail. It is queued as psycopg
        queues a cursor's statement; a psycopg without these queues gets
        ``execute``, and that rare loss back.
        """
        commands = getattr(self._pipeline, "command_queue", None)
        replies = getattr(self._pipeline, "result_queue", None)
        if isinstance(commands, deque) and isinstance(replies, deque):
            self._commit = reply = _CommitReply(self._raw.info.encoding)
            commands.append(partial(self._raw.pgconn.send_query_params, b"COMMIT", None))
            replies.append((reply, None))
        else:
            self._commit = cursor = self._raw.cursor()
            cursor.execute("COMMIT")  # may already raise the INSERT's refusal

    def finish(self) -> None:
        self._exited = True
        self._context.__exit__(None, None, None)

    def leave(self, exc_info: Any) -> None:
        if self._exited or self._raw.closed or self._raw.pgconn.pipeline_status == pq.PipelineStatus.OFF:
            return
        self._exited = True
        self._context.__exit__(*exc_info)


@dataclass(slots=True)
class _Pending:
    raw: psycopg.Connection[Any]
    batch: _PsycopgBatch | DirectBatch
    statement: str
    #: Takes the rows a keyed INSERT stored once its reply is read (``rows.write_events``).
    on_reply: Settle | None = None
    #: Set when a statement read the reply early and it was an error: the COMMIT must fail too.
    failure: psycopg.Error | None = None


_pending = _hooks.pending


def pipeline_connection(connection: Connection) -> psycopg.Connection[Any] | None:
    """The psycopg connection to pipeline on, or None where the plain INSERT must be used.

    Not for asyncio drivers (their pipeline is a coroutine API), autocommit
    connections (there is no COMMIT to ride with), a connection inside a
    savepoint, a connection already in pipeline mode (the application's own
    pipeline), or a libpq older than 14, which has no pipeline mode.
    """
    if not _SUPPORTED or not _hooks.attached() or connection.in_nested_transaction():
        return None
    raw: Any = connection.connection.dbapi_connection
    if type(raw) is not psycopg.Connection or raw.autocommit:
        return None
    if raw.pgconn.pipeline_status != pq.PipelineStatus.OFF or id(raw) in _pending:
        return None
    return raw


def send_in_pipeline(
    connection: Connection,
    raw: psycopg.Connection[Any],
    sql: str,
    params: tuple[Any, ...],
    *,
    on_reply: Settle | None = None,
) -> None:
    """Send the INSERT without waiting; its reply is read by the hooks below.

    ``on_reply`` is handed the rows a keyed INSERT stored once its reply has
    been read without error (not when a rollback discards it).
    """
    try:
        prepared = prepared_statement(raw, sql, params)
        batch = DirectBatch(raw, prepared) if prepared else _PsycopgBatch(raw, sql, params)
    except psycopg.Error as exc:
        _raise(connection, exc, sql, params)
    _pending[id(raw)] = _Pending(raw, batch, sql, on_reply)


def _settle(pending: _Pending) -> None:
    """Hand the stored rows over; it only remembers what was dropped, and must never fail a commit."""
    if pending.on_reply is None:
        return
    batch = pending.batch
    try:
        pending.on_reply(batch.stored_count(), batch.stored_pairs)
    except Exception:
        log.warning(
            "could not tell which outbox rows were dropped as duplicates",
            exc_info=True,
            extra={"action": "deduplicated"},
        )


def _raw_of(connection: Connection) -> Any:
    """The DBAPI connection, without checking one out or raising for an invalidated Connection."""
    if connection.closed or connection.invalidated:
        return None
    return connection.connection.dbapi_connection


def _raise(connection: Connection, exc: psycopg.Error, statement: str, params: Any) -> NoReturn:
    """Raise ``exc`` as SQLAlchemy does for its statements: wrapped, through handle_error, disconnects."""
    handle = getattr(connection, "_handle_dbapi_exception", None)
    if handle is not None:
        handle(exc, statement, params, None, None)
    # Without SQLAlchemy's internal handler: the same, by hand (no handle_error listeners).
    raw: Any = _raw_of(connection)
    invalidated = connection.dialect.is_disconnect(exc, raw, None)  # type: ignore[arg-type]
    if invalidated:
        connection.invalidate(exc)
    raise _wrapped(connection, exc, statement, params, invalidated=invalidated) from exc


def _rollback_quietly(raw: psycopg.Connection[Any]) -> None:
    # An INSERT refused in the pipeline skips the COMMIT and leaves the server
    # in an aborted transaction that SQLAlchemy believes is over: end it here.
    if raw.info.transaction_status == pq.TransactionStatus.INERROR:
        try:
            raw.rollback()
        except psycopg.Error as exc:
            log.debug("rollback after a refused outbox INSERT failed: %s", type(exc).__name__)


def _abandon(connection: Connection, raw: psycopg.Connection[Any]) -> None:
    """Interrupted while the server works: stop it, and never reuse the connection."""
    try:
        raw.cancel_safe(timeout=5.0)
    except Exception as exc:  # the connection may already be gone
        log.debug("cancelling the interrupted outbox commit failed: %s", type(exc).__name__)
    try:
        connection.invalidate()
    except Exception as exc:
        log.debug("invalidating the interrupted connection failed: %s", type(exc).__name__)


def _take(connection: Connection) -> _Pending | None:
    raw = _raw_of(connection)
    return None if raw is None else _pending.pop(id(raw), None)


def _read(pending: _Pending) -> None:
    """Leave pipeline mode, reading the replies; a refusal is raised as psycopg's error."""
    pending.batch.finish()


def before_statement(connection: Connection) -> None:
    pending = _take(connection)
    if pending is None:
        return
    if pending.failure is not None:
        # Someone already saw (and perhaps swallowed) the refusal: nothing else may run.
        _pending[id(pending.raw)] = pending
        raise _wrapped(connection, pending.failure, pending.statement)
    try:
        _read(pending)
        _settle(pending)
    except psycopg.Error as exc:
        _give_up_if_interrupted(connection, pending, exc)
        pending.failure = exc
        _pending[id(pending.raw)] = pending  # kept: the commit must raise it again
        # Raised wrapped but not handled here: SQLAlchemy's handling of the
        # statement being run passes it to handle_error listeners once.
        raise _wrapped(connection, exc, pending.statement) from exc
    except BaseException:
        _abandon(connection, pending.raw)
        raise


def _wrapped(
    connection: Connection,
    exc: psycopg.Error,
    statement: str,
    params: Any = None,
    *,
    invalidated: bool = False,
) -> StatementError:
    return DBAPIError.instance(
        statement,
        params,
        exc,
        psycopg.Error,
        hide_parameters=connection.engine.hide_parameters,
        connection_invalidated=invalidated,
        dialect=connection.dialect,
    )


def _give_up_if_interrupted(connection: Connection, pending: _Pending, exc: psycopg.Error) -> None:
    """A timeout or signal cut the wait short and psycopg reported its own state instead: re-raise it.

    psycopg leaving pipeline mode mid-wait raises "cannot exit pipeline mode
    while busy", hiding the caller's exception in ``__context__``; the
    connection is then still busy and must be given up, not reused. So must
    one that could not leave pipeline mode for any other reason (a reply
    still unread, as when the server's FATAL came before the end of the
    connection).
    """
    cause = exc.__context__
    interrupted = cause is not None and not isinstance(cause, psycopg.Error)
    raw = pending.raw
    stuck = not raw.closed and (
        raw.info.transaction_status not in _SETTLED or raw.pgconn.pipeline_status != pq.PipelineStatus.OFF
    )
    if interrupted or stuck:
        _abandon(connection, pending.raw)
        _leave(pending, (type(exc), exc, exc.__traceback__))
        if interrupted:
            assert cause is not None
            raise cause


def before_commit(connection: Connection) -> None:
    pending = _take(connection)
    if pending is None:
        return
    raw = pending.raw
    if pending.failure is not None:
        _rollback_quietly(raw)
        _raise(connection, pending.failure, pending.statement, None)
    # The COMMIT rides in the pipeline only if no commit listener comes after
    # this one: a later listener may still veto, and must see nothing committed.
    ride = _hooks.is_last_commit_listener(connection)
    try:
        if ride:
            pending.batch.send_commit()
        _read(pending)
        _settle(pending)
    except psycopg.Error as exc:
        if ride and pending.batch.committed:
            # The server said COMMIT: the commit succeeded, only the connection is lost.
            _retire(connection, raw, exc)
            if exc.__context__ is not None and not isinstance(exc.__context__, psycopg.Error):
                raise exc.__context__ from None  # an interruption (see _give_up_if_interrupted)
            return
        _give_up_if_interrupted(connection, pending, exc)
        _leave(pending, sys.exc_info())
        _rollback_quietly(raw)
        _raise(connection, exc, "COMMIT" if pending.batch.inserted else pending.statement, None)
    except BaseException:
        # Interrupted while waiting: stop the server's work before anything else waits on it.
        _abandon(connection, raw)
        _leave(pending, sys.exc_info())
        raise


def _retire(connection: Connection, raw: psycopg.Connection[Any], exc: psycopg.Error) -> None:
    """The COMMIT was confirmed, then the connection was lost: a closed connection, not a failed commit.

    SQLAlchemy still calls the DBAPI connection's ``commit()`` after its commit
    event (where this runs), and the pool calls ``rollback()`` when the
    connection is returned; on a lost psycopg connection both raise, the first
    failing a commit that succeeded, the second logging an error. Neither has
    anything left to do, so this dead connection object is given ones that do
    nothing, and its pool entry is invalidated (softly: SQLAlchemy is still
    using it): the pool opens a new connection at its next checkout instead of
    handing this one out.
    """
    reason: BaseException = exc
    while isinstance(reason.__context__, psycopg.Error):  # psycopg's "cannot exit pipeline mode" hides it
        reason = reason.__context__
    log.warning(
        "the connection was lost after PostgreSQL confirmed the COMMIT: the transaction is "
        "committed; the connection is discarded (%s)",
        first_line(reason),
        extra={"action": "commit_connection_lost"},
    )
    try:
        raw.close()
    except Exception as close_exc:
        log.debug("closing the lost connection failed: %s", type(close_exc).__name__)
    raw.commit = raw.rollback = _nothing_to_do  # type: ignore[method-assign]
    connection.connection.invalidate(exc, soft=True)


def _nothing_to_do() -> None:
    """commit() and rollback() of a connection lost after its COMMIT was confirmed."""


def _leave(pending: _Pending, exc_info: Any) -> None:
    """Leave pipeline mode after a failure, if the failure came before the final read did."""
    try:
        pending.batch.leave(exc_info)
    except Exception as exc:  # the connection is already being given up
        log.debug("leaving pipeline mode after a failure failed: %s", type(exc).__name__)


def before_rollback(connection: Connection) -> None:
    pending = _take(connection)
    if pending is not None:
        _discard(pending)


def leaving_pool(dbapi_connection: Any) -> None:
    pending = _pending.pop(id(dbapi_connection), None)
    if pending is not None:
        _discard(pending)


def _discard(pending: _Pending) -> None:
    """Leave pipeline mode on the way to a rollback; what the INSERT said no longer matters."""
    if pending.failure is not None:
        return  # its pipeline was left when the failure was read
    try:
        _read(pending)
    except psycopg.Error as exc:
        log.debug("outbox INSERT discarded by a rollback: %s", type(exc).__name__)


_hooks.use_reader(
    _hooks.Reader(
        before_statement=before_statement,
        before_commit=before_commit,
        before_rollback=before_rollback,
        leaving_pool=leaving_pool,
    )
)
