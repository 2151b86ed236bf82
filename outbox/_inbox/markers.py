"""The marker: one INSERT in the caller's transaction that tells a first delivery from a duplicate.

``INSERT ... ON CONFLICT DO NOTHING`` on the primary key (consumer, message
id), and the count of rows it inserted is the answer: 1 the first time, 0 for
a duplicate. No savepoint, no read before the write, no error to catch.

Two transactions receiving the same id at once, on PostgreSQL: the second's
INSERT finds the first's uncommitted row in the primary key and waits for that
transaction to end. If it commits, the second sees the conflict and inserts
nothing (a duplicate, no error); if it rolls back, the second inserts (the
first time after all). Exactly one wins, and the loser never sees an error
under READ COMMITTED, PostgreSQL's default. Under REPEATABLE READ or
SERIALIZABLE, PostgreSQL refuses such a loser with a serialization failure
instead, which a retry answers as a duplicate. One marker per transaction
cannot deadlock: a waiting transaction holds no marker another one waits for.

On SQLite the database's single write lock puts writers in line; the second
transaction's INSERT runs after the first has ended.

``received_at`` comes from the database's clock on PostgreSQL (the column's
default; the consumer's login is not granted the column), and ``kept_until``
is computed there from it. SQLite has no clock of its own worth the name:
this host's is used.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Interval, bindparam, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from .._tables import outbox_inbox
from .sessions import async_connection_of, connection_of
from .settings import InboxSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

__all__ = ["BIND", "mark", "mark_async"]

#: The marker table's own bind, so ``sessionmaker(binds={...})`` works without a default bind.
BIND: Final = {"clause": outbox_inbox}

_PG_MARK: Final[Insert] = (
    postgresql.insert(outbox_inbox)
    # The other columns come from the parameters; received_at from the column's default.
    .values(kept_until=func.now() + bindparam("keep", type_=Interval()))
    # No conflict target: the primary key is the table's only unique index, and naming it would
    # need SELECT on its columns, which the consumer's login is not granted.
    .on_conflict_do_nothing()
    # The answer is the row count, which SQLAlchemy keeps for an INSERT only when asked to.
    .execution_options(preserve_rowcount=True)
)
#: psycopg, the hot path: the statement as text with positional parameters, so no compiled-cache
#: lookup or bind processing runs per message (as ``emit()``'s INSERT on psycopg).
_PSYCOPG_MARK: Final = (
    "INSERT INTO outbox_inbox (consumer, message_id, event_type, source, outcome, kept_until)"
    " VALUES (%s, %s, %s, %s, %s, now() + %s) ON CONFLICT DO NOTHING"
)
_COUNTED: Final = {"preserve_rowcount": True}
_SQLITE_MARK: Final[Insert] = (
    sqlite.insert(outbox_inbox).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
)


def _params(
    settings: InboxSettings,
    message_id: str,
    outcome: str,
    event_type: str | None,
    source: str | None,
    dialect: str,
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "consumer": settings.name,
        "message_id": message_id,
        "event_type": event_type,
        "source": source,
        "outcome": outcome,
    }
    if dialect == "postgresql":
        params["keep"] = settings.keep
    else:
        now = datetime.now(UTC)
        params["received_at"] = now
        params["kept_until"] = now + settings.keep
    return params


def mark(
    settings: InboxSettings,
    session: Session | Connection,
    message_id: str,
    outcome: str,
    *,
    event_type: str | None,
    source: str | None,
    what: str = "receive",
) -> bool:
    """Write the marker in ``session``'s transaction; True if this is the first time.

    ``message_id``, ``event_type`` and ``source`` are checked already.
    """
    connection = connection_of(session, what, BIND)
    dialect = connection.dialect.name
    if dialect == "postgresql" and connection.dialect.driver == "psycopg":
        row = (settings.name, message_id, event_type, source, outcome, settings.keep)
        return connection.exec_driver_sql(_PSYCOPG_MARK, row, execution_options=_COUNTED).rowcount == 1
    statement = _PG_MARK if dialect == "postgresql" else _SQLITE_MARK
    params = _params(settings, message_id, outcome, event_type, source, dialect)
    return connection.execute(statement, params).rowcount == 1


async def mark_async(
    settings: InboxSettings,
    session: AsyncSession | AsyncConnection,
    message_id: str,
    outcome: str,
    *,
    event_type: str | None,
    source: str | None,
    what: str = "receive",
) -> bool:
    """:func:`mark` for an ``AsyncSession`` or ``AsyncConnection``."""
    connection = await async_connection_of(session, what, BIND)
    dialect = connection.dialect.name
    statement = _PG_MARK if dialect == "postgresql" else _SQLITE_MARK
    params = _params(settings, message_id, outcome, event_type, source, dialect)
    return (await connection.execute(statement, params)).rowcount == 1
