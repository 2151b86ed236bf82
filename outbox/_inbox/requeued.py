"""A requeued dead letter as its consumer sees it: read, taken in the handlers' transaction, or put back.

An operator requeues a dead letter (``outbox.ops.requeue_inbox_dead_letter``:
status ``dead`` → ``requeued``). Its consumer then, for each one:

- **reads** it: ``outbox_inbox_requeued(consumer, max_rows)`` on PostgreSQL,
  a function that returns the requeued dead letters of that consumer only (its
  login may not read the others' payloads), oldest first;
- **takes** it in the transaction its handlers run in:
  ``outbox_inbox_take(consumer, id)`` marks it ``handled``, or answers False
  when it is not requeued any more or another transaction holds it (``FOR
  UPDATE SKIP LOCKED``: of two consumer processes exactly one takes it, and
  neither waits for the other's handlers). The mark commits with the
  handlers' effects, or rolls back with them;
- **puts it back** when the handlers failed: ``outbox_inbox_dead_again``, in a
  new transaction, makes it ``dead`` again with the new error (and one more
  attempt when a handler ran), if it is still requeued.

Migration ``outbox_0022`` made those functions (``SECURITY DEFINER``, owned by
the tables' owner); SQLite has no roles, and the same UPDATEs run from here,
in line behind the database's write lock. ``requeued_at``, ``handled_at`` and
``dead_at`` are the database's clock on PostgreSQL, this host's UTC clock on
SQLite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Text, cast, select, text, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Executable

from .._exceptions import ConfigurationError
from .._tables import outbox_inbox_dead
from .dead import error_name, error_text
from .message import InboxMessage

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = [
    "DEAD_BIND",
    "MAX_REQUEUED",
    "Requeued",
    "check_limit",
    "dead_again",
    "dead_again_async",
    "read",
    "read_async",
    "take",
    "take_async",
]

d = outbox_inbox_dead
#: The dead letters' own bind, so ``sessionmaker(binds={...})`` works without a default bind.
DEAD_BIND: Final = {"clause": outbox_inbox_dead}
#: The most requeued dead letters one read returns (the database function's limit too).
MAX_REQUEUED: Final = 1000

_PG_READ: Final = text(
    "SELECT dead_id, message_id, event_type, source, payload, headers, sent_at, attempts"
    " FROM outbox_inbox_requeued(:consumer, :max_rows)"
)
_PG_TAKE: Final = text("SELECT outbox_inbox_take(:consumer, :dead_id)")
_PG_DEAD_AGAIN: Final = text(
    "SELECT outbox_inbox_dead_again(:consumer, :dead_id, :error_type, :error, :counted)"
)


@dataclass(frozen=True, slots=True)
class Requeued:
    """One requeued dead letter: its id, and its message as the consumer's handlers get it."""

    dead_id: int
    message: InboxMessage


def check_limit(limit: Any) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_REQUEUED:
        raise ValueError(f"limit must be a whole number from 1 to {MAX_REQUEUED}, got {limit!r}")
    return limit


def _read_statement(dialect: str, consumer: str, limit: int) -> tuple[Executable, dict[str, Any]]:
    if dialect == "postgresql":
        return _PG_READ, {"consumer": consumer, "max_rows": limit}
    query = (
        select(
            d.c.id.label("dead_id"),
            d.c.message_id,
            d.c.event_type,
            d.c.source,
            cast(d.c.payload, Text).label("payload"),
            cast(d.c.headers, Text).label("headers"),
            d.c.sent_at,
            d.c.attempts,
        )
        .where(d.c.consumer == consumer, d.c.status == "requeued")
        .order_by(d.c.id)
        .limit(limit)
    )
    return query, {}


def _document(stored: str | None) -> Any:
    return None if stored is None else json.loads(stored)


def _letters(rows: list[Row[Any]]) -> list[Requeued]:
    """Each row as the message a source handed in, delivered once more than its handlers ran it."""
    letters = []
    for row in rows:
        headers = _document(row.headers)
        message = InboxMessage(
            row.message_id,
            row.event_type,
            _document(row.payload),
            # A header set JSON could not hold was stored as its repr: there are no headers to hand back.
            headers if isinstance(headers, dict) else {},
            row.source,
            row.sent_at,
            attempt=row.attempts + 1,
        )
        letters.append(Requeued(int(row.dead_id), message))
    return letters


def _explained(error: DBAPIError) -> ConfigurationError | None:
    """The one-line reason when the functions are missing (an older schema) or not granted, else None."""
    state = getattr(error.orig, "sqlstate", None) or getattr(error.orig, "pgcode", None)
    said = str(error.orig)
    if state == "42883" and "outbox_inbox_" in said:
        return ConfigurationError(
            "this database has no functions for requeued inbox dead letters yet: run `outbox migrate` first"
        )
    if state == "42501" and "function outbox_inbox_" in said:
        return ConfigurationError(
            "this login may not take requeued inbox dead letters: grant it EXECUTE on outbox_inbox_requeued,"
            " outbox_inbox_take and outbox_inbox_dead_again (docs/operations.md, Least privilege)"
        )
    return None


def _run(connection: Connection, statement: Executable, params: dict[str, Any]) -> Any:
    try:
        return connection.execute(statement, params)
    except DBAPIError as error:
        explained = _explained(error)
        if explained is not None:
            raise explained from None
        raise


async def _run_async(connection: AsyncConnection, statement: Executable, params: dict[str, Any]) -> Any:
    try:
        return await connection.execute(statement, params)
    except DBAPIError as error:
        explained = _explained(error)
        if explained is not None:
            raise explained from None
        raise


def read(connection: Connection, consumer: str, limit: int) -> list[Requeued]:
    """The consumer's requeued dead letters, oldest first, at most ``limit``."""
    statement, params = _read_statement(connection.dialect.name, consumer, limit)
    return _letters(_run(connection, statement, params).all())


async def read_async(connection: AsyncConnection, consumer: str, limit: int) -> list[Requeued]:
    statement, params = _read_statement(connection.dialect.name, consumer, limit)
    return _letters((await _run_async(connection, statement, params)).all())


def _take_statement(dialect: str, consumer: str, dead_id: int) -> tuple[Executable, dict[str, Any]]:
    if dialect == "postgresql":
        return _PG_TAKE, {"consumer": consumer, "dead_id": dead_id}
    statement = (
        update(d)
        .where(d.c.id == dead_id, d.c.consumer == consumer, d.c.status == "requeued")
        .values(status="handled", handled_at=datetime.now(UTC))
    )
    return statement, {}


def _taken(dialect: str, result: Any) -> bool:
    return bool(result.scalar_one()) if dialect == "postgresql" else result.rowcount == 1


def take(connection: Connection, consumer: str, dead_id: int) -> bool:
    """Mark it ``handled`` in the connection's transaction: True if this transaction took it."""
    dialect = connection.dialect.name
    statement, params = _take_statement(dialect, consumer, dead_id)
    return _taken(dialect, _run(connection, statement, params))


async def take_async(connection: AsyncConnection, consumer: str, dead_id: int) -> bool:
    dialect = connection.dialect.name
    statement, params = _take_statement(dialect, consumer, dead_id)
    return _taken(dialect, await _run_async(connection, statement, params))


def _dead_again_statement(
    dialect: str, consumer: str, dead_id: int, error: BaseException, counted: bool
) -> tuple[Executable, dict[str, Any]]:
    kind, said = error_name(error), error_text(error)
    if dialect == "postgresql":
        params = {"consumer": consumer, "dead_id": dead_id, "error_type": kind, "error": said}
        return _PG_DEAD_AGAIN, {**params, "counted": counted}
    statement = (
        update(d)
        .where(d.c.id == dead_id, d.c.consumer == consumer, d.c.status == "requeued")
        .values(
            status="dead",
            error_type=kind,
            error=said,
            attempts=d.c.attempts + (1 if counted else 0),
            dead_at=datetime.now(UTC),
        )
    )
    return statement, {}


def dead_again(
    connection: Connection, consumer: str, dead_id: int, error: BaseException, *, counted: bool
) -> bool:
    """Make it ``dead`` again with ``error`` (one more attempt if ``counted``); False if not requeued now."""
    dialect = connection.dialect.name
    statement, params = _dead_again_statement(dialect, consumer, dead_id, error, counted)
    return _taken(dialect, _run(connection, statement, params))


async def dead_again_async(
    connection: AsyncConnection, consumer: str, dead_id: int, error: BaseException, *, counted: bool
) -> bool:
    dialect = connection.dialect.name
    statement, params = _dead_again_statement(dialect, consumer, dead_id, error, counted)
    return _taken(dialect, await _run_async(connection, statement, params))
