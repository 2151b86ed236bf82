"""Dead letters: a message the inbox will not retry on its own, kept whole for an operator.

A dead letter is written in one transaction with the message's marker
(outcome ``dead``), before the source is acknowledged: a redelivery is then a
duplicate, and nothing is acknowledged that is not recorded. ``dead_at`` is
the database's clock on PostgreSQL (the column's default).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from .._first_line import first_line
from .._tables import outbox_inbox_dead
from .markers import BIND, mark, mark_async
from .message import InboxMessage
from .sessions import async_connection_of, connection_of
from .settings import InboxSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["bury", "bury_async", "error_name", "error_text"]

_ERROR_LIMIT = 2000
_NAME_LIMIT = 255
_REPR_LIMIT = 10_000

d = outbox_inbox_dead
_CONFLICT = ["consumer", "message_id"]
_PG_DEAD: Final[Insert] = (
    postgresql.insert(d).on_conflict_do_nothing(index_elements=_CONFLICT).returning(d.c.id)
)
_SQLITE_DEAD: Final[Insert] = (
    sqlite.insert(d).on_conflict_do_nothing(index_elements=_CONFLICT).returning(d.c.id)
)


def error_name(error: BaseException) -> str:
    """The exception's public type name: ``ValueError``, ``outbox.NoInboxHandler``, ``myapp.Refused``."""
    kind = type(error)
    # The public path (outbox.MessageTooOld), not the private module it lives in, as the relay says it.
    module = "outbox" if kind.__module__.startswith("outbox._") else kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    return name[:_NAME_LIMIT]


def error_text(error: BaseException) -> str:
    """The error as a dead letter stores it: its first line, at most 2,000 characters, no NUL."""
    return first_line(error)[:_ERROR_LIMIT].replace("\x00", "\\x00")


def _storable(value: Any) -> Any:
    """``value`` if JSON can hold it as it is; else its ``repr`` as a JSON string: shown, not lost."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value)[:_REPR_LIMIT].replace("\x00", "\\x00")
    if "\\u0000" in text:  # PostgreSQL's JSON refuses it
        return repr(value)[:_REPR_LIMIT].replace("\x00", "\\x00")
    return value


def _row(
    consumer: str, message: InboxMessage, error: BaseException, *, attempts: int, dialect: str
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "consumer": consumer,
        "message_id": message.id,
        "event_type": message.event_type,
        "source": message.source,
        "payload": _storable(message.payload),
        "headers": _storable(dict(message.headers)),
        "sent_at": message.sent_at,
        "attempts": attempts,
        "error_type": error_name(error),
        "error": error_text(error),
    }
    if dialect != "postgresql":
        row["dead_at"] = datetime.now(UTC)
    return row


def _existing(consumer: str, message_id: str) -> Any:
    return select(d.c.id).where(d.c.consumer == consumer, d.c.message_id == message_id)


def _write(connection: Connection, row: dict[str, Any]) -> int:
    """Insert the dead letter (unless one of this consumer and id is kept already); its id."""
    statement = _PG_DEAD if connection.dialect.name == "postgresql" else _SQLITE_DEAD
    found = connection.execute(statement, row).scalar()
    if found is None:
        found = connection.execute(_existing(row["consumer"], row["message_id"])).scalar_one()
    return int(found)


async def _write_async(connection: AsyncConnection, row: dict[str, Any]) -> int:
    statement = _PG_DEAD if connection.dialect.name == "postgresql" else _SQLITE_DEAD
    found = (await connection.execute(statement, row)).scalar()
    if found is None:
        found = (await connection.execute(_existing(row["consumer"], row["message_id"]))).scalar_one()
    return int(found)


def bury(
    settings: InboxSettings,
    session: Session | Connection,
    message: InboxMessage,
    error: BaseException,
    attempts: int,
) -> int | None:
    """Marker (outcome ``dead``) and dead letter in ``session``'s transaction; None if the marker was there.

    ``message`` is checked already.
    """
    connection = connection_of(session, "dead_letter", BIND)
    if not mark(
        settings, connection, message.id, "dead", event_type=message.event_type, source=message.source
    ):
        return None
    return _write(
        connection, _row(settings.name, message, error, attempts=attempts, dialect=connection.dialect.name)
    )


async def bury_async(
    settings: InboxSettings,
    session: AsyncSession | AsyncConnection,
    message: InboxMessage,
    error: BaseException,
    attempts: int,
) -> int | None:
    """:func:`bury` for an ``AsyncSession`` or ``AsyncConnection``."""
    connection = await async_connection_of(session, "dead_letter", BIND)
    if not await mark_async(
        settings, connection, message.id, "dead", event_type=message.event_type, source=message.source
    ):
        return None
    row = _row(settings.name, message, error, attempts=attempts, dialect=connection.dialect.name)
    return await _write_async(connection, row)
