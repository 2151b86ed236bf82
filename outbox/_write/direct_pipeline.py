"""The pipelined outbox INSERT sent straight through libpq, under psycopg's own prepared statement.

psycopg's ``Pipeline`` costs an emitting request about 100 µs of CPU a commit
(its result queue, cursors and generators), more than the server spends
executing the INSERT. Once psycopg has prepared the INSERT on a connection,
this module sends Bind and Execute for that statement, then the COMMIT and a
Sync, and reads the replies with libpq: about 100 µs of CPU less a commit
(bench/RESULTS.md, "Emit").

The statement must be psycopg's, not one of our own: psycopg deallocates every
prepared statement (``DEALLOCATE ALL``) at each rollback of a transaction and
when a DROP, ALTER or DISCARD ALL goes through one of its cursors, and evicts
old ones past ``prepared_max``. Its table of names is the only record of which
statements still exist on the server, so a statement of our own could vanish
and fail a user's commit. psycopg keeps that table private (``Connection._prepared``);
it is read defensively here, and where anything is not as expected
``prepared_statement`` answers None and the caller uses psycopg's ``Pipeline``,
which is as correct and only slower.
"""

from __future__ import annotations

import select
import weakref
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer
from psycopg.errors import error_from_result

try:
    from psycopg._queries import PostgresQuery
except ImportError:  # a psycopg without it: psycopg's Pipeline is used
    PostgresQuery = None  # type: ignore[assignment,misc]

__all__ = ["DirectBatch", "Statement", "prepared_statement"]

_SYNC = pq.ExecStatus.PIPELINE_SYNC
_FATAL = pq.ExecStatus.FATAL_ERROR
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMIT = b"COMMIT"
_HAS_POLL = hasattr(select, "poll")

#: (name, parameters as psycopg dumped them, their formats)
Statement = tuple[bytes, Sequence[Any], Sequence[pq.Format] | None]


#: Per connection, each statement text converted once (psycopg's own query object, parsed for
#: its placeholders, with a Transformer that keeps the dumpers it looked up): a commit only
#: dumps its parameters, 2 µs instead of 9. Keyed weakly, and the Transformer reaches the
#: connection through a weak proxy, so nothing here keeps a dropped connection alive.
_converted: weakref.WeakKeyDictionary[psycopg.Connection[Any], dict[str, Any]] = weakref.WeakKeyDictionary()
#: Statement texts kept per connection; past it the cache starts over (batches of many sizes).
_CONVERTED_MAX = 64


class _Context:
    """What a Transformer takes from a connection (its adapters, and the connection for its encoding)."""

    __slots__ = ("adapters", "connection")

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.adapters = raw.adapters
        self.connection = weakref.proxy(raw)


def _query_for(raw: psycopg.Connection[Any], sql: str, params: Sequence[Any]) -> Any:
    """``sql`` converted with ``params`` dumped, as psycopg's cursor would convert it."""
    queries = _converted.get(raw)
    if queries is None:
        queries = _converted[raw] = {}
    query: Any = queries.get(sql)
    if query is None:
        if len(queries) >= _CONVERTED_MAX:
            queries.clear()
        query = PostgresQuery(Transformer(_Context(raw)))
        query.convert(sql, params)
        queries[sql] = query
    else:
        query.dump(params)
    return query


def prepared_statement(raw: psycopg.Connection[Any], sql: str, params: Sequence[Any]) -> Statement | None:
    """psycopg's prepared statement for ``sql`` with these parameters' types, if it has one."""
    names = getattr(getattr(raw, "_prepared", None), "_names", None)
    if not names or PostgresQuery is None or not isinstance(names, dict):
        return None
    query = _query_for(raw, sql, params)
    # psycopg's own cache key (PrepareManager.key): the converted query and the parameters' types.
    name = names.get((query.query, query.types))
    if not isinstance(name, bytes) or query.params is None:
        return None
    return name, query.params, query.formats


class DirectBatch:
    """The INSERT sent in libpq pipeline mode; the COMMIT may follow; one Sync ends it."""

    __slots__ = ("_raw", "_pgconn", "inserted", "_stored", "committed")

    def __init__(self, raw: psycopg.Connection[Any], statement: Statement) -> None:
        name, params, formats = statement
        self._raw = raw
        self._pgconn = pgconn = raw.pgconn
        #: The INSERT's reply said it succeeded (known once ``finish`` has read it).
        self.inserted = False
        #: Its RETURNING rows, when it has a RETURNING clause (a batch with keys).
        self._stored: pq.abc.PGresult | None = None
        #: The COMMIT's reply said it committed: true from the moment it is read,
        #: even if the connection is lost before the Sync's.
        self.committed = False
        pgconn.enter_pipeline_mode()
        try:
            pgconn.send_query_prepared(name, params, param_formats=formats)
            pgconn.flush()  # on its way now, so the server works while SQLAlchemy winds up
        except BaseException:
            self.leave()
            raise

    def send_commit(self) -> None:
        self._pgconn.send_query_params(_COMMIT, None)

    def finish(self) -> None:
        """Read every reply up to the Sync and leave pipeline mode; raise the first refusal."""
        pgconn = self._pgconn
        pgconn.pipeline_sync()
        refusal: pq.abc.PGresult | None = None
        replies = 0
        while True:
            while pgconn.is_busy():
                _wait(pgconn)
            result = pgconn.get_result()
            if result is None:  # the end of one statement's replies
                if pgconn.status != pq.ConnStatus.OK:
                    raise psycopg.OperationalError("the connection was lost reading the commit's replies")
                continue
            status = result.status
            if status == _SYNC:
                break
            replies += 1
            if replies == 1 and status in (_COMMAND_OK, _TUPLES_OK):
                self.inserted = True
                self._stored = result if status == _TUPLES_OK else None
            elif status == _COMMAND_OK and replies == 2 and result.command_status == _COMMIT:
                # (A COMMIT in a failed transaction answers ROLLBACK.)
                self.committed = True
            elif status == _FATAL and refusal is None:
                refusal = result
        pgconn.exit_pipeline_mode()
        if refusal is not None:
            raise error_from_result(refusal, encoding=self._raw.info.encoding)

    def stored_count(self) -> int:
        """How many rows the INSERT's RETURNING gave back: the rows it stored."""
        return 0 if self._stored is None else self._stored.ntuples

    def stored_pairs(self) -> list[tuple[str | None, str | None]]:
        """The RETURNING rows, ``(handler, idempotency_key)`` as text."""
        result, encoding = self._stored, self._raw.info.encoding
        if result is None:
            return []
        return [
            tuple(  # type: ignore[misc]
                None if (value := result.get_value(row, column)) is None else bytes(value).decode(encoding)
                for column in (0, 1)
            )
            for row in range(result.ntuples)
        ]

    def leave(self, exc_info: Any = None) -> None:
        """After a failure: leave pipeline mode if libpq allows it (nothing may be left to read)."""
        pgconn = self._pgconn
        if pgconn.status == pq.ConnStatus.OK and pgconn.pipeline_status != pq.PipelineStatus.OFF:
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.Error:
                pass  # replies still pending: the connection is being given up by the caller


def _wait(pgconn: pq.abc.PGconn) -> None:
    """Until a reply can be read: send what is unsent, wait on the socket, take in what came.

    An interruption (a signal's exception) is raised from the wait to the
    caller, which cancels the server's work and gives the connection up.
    """
    unsent = pgconn.flush()
    socket = pgconn.socket
    if _HAS_POLL:  # no limit on the descriptor's number, unlike select()
        poller = select.poll()
        poller.register(socket, select.POLLIN | (select.POLLOUT if unsent else 0))
        poller.poll()
    else:
        select.select([socket], [socket] if unsent else [], [])
    pgconn.consume_input()
