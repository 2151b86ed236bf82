"""A partitioned log's positions (Kafka), kept in the database with the effects they account for.

A consumer that commits its offsets to the broker after its database
transaction re-reads, after a crash between the two, records whose effects are
committed; one that commits them before loses records. Storing the next offset
in ``outbox_inbox_offset`` in the same transaction as the record's effects
leaves neither gap nor replay: on assignment the consumer seeks to what is
stored. The stored offset never moves backwards, so a consumer that lost its
partition in a rebalance and writes late cannot rewind the one that has it now.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import Insert

from .._exceptions import InvalidInboxMessage
from .._tables import outbox_inbox_offset
from .checks import check_text
from .sessions import async_connection_of, connection_of

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
    from sqlalchemy.sql import Select

__all__ = ["stored", "stored_async", "store", "store_async"]

o = outbox_inbox_offset
BIND: Final = {"clause": outbox_inbox_offset}
_KEY = ["consumer", "topic", "partition"]
_MAX_OFFSET = 2**63 - 1


def _upsert() -> tuple[Insert, Insert]:
    pg = postgresql.insert(o)
    pg = pg.on_conflict_do_update(
        index_elements=_KEY,
        set_={
            "next_offset": func.greatest(o.c.next_offset, pg.excluded.next_offset),
            "updated_at": func.now(),
        },
    )
    lite = sqlite.insert(o)
    lite = lite.on_conflict_do_update(
        index_elements=_KEY,
        set_={
            "next_offset": func.max(o.c.next_offset, lite.excluded.next_offset),
            "updated_at": lite.excluded.updated_at,
        },
    )
    return pg, lite


_PG_UPSERT, _SQLITE_UPSERT = _upsert()


def _params(consumer: str, topic: Any, partition: Any, next_offset: Any, dialect: str) -> dict[str, Any]:
    check_text("topic", topic, required=True)
    for what, value, top in (("partition", partition, 2**31 - 1), ("next_offset", next_offset, _MAX_OFFSET)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise InvalidInboxMessage(f"{what} must be an int from 0 to {top}, got {value!r}")
    params: dict[str, Any] = {
        "consumer": consumer,
        "topic": topic,
        "partition": partition,
        "next_offset": next_offset,
    }
    if dialect != "postgresql":
        params["updated_at"] = datetime.now(UTC)
    return params


def store(consumer: str, session: Session | Connection, topic: str, partition: int, next_offset: int) -> None:
    connection = connection_of(session, "store_offset", BIND)
    dialect = connection.dialect.name
    params = _params(consumer, topic, partition, next_offset, dialect)
    connection.execute(_PG_UPSERT if dialect == "postgresql" else _SQLITE_UPSERT, params)


async def store_async(
    consumer: str, session: AsyncSession | AsyncConnection, topic: str, partition: int, next_offset: int
) -> None:
    connection = await async_connection_of(session, "store_offset", BIND)
    dialect = connection.dialect.name
    params = _params(consumer, topic, partition, next_offset, dialect)
    await connection.execute(_PG_UPSERT if dialect == "postgresql" else _SQLITE_UPSERT, params)


def _query(consumer: str, topic: Any) -> Select[Any]:
    check_text("topic", topic, required=True)
    return select(o.c.partition, o.c.next_offset).where(o.c.consumer == consumer, o.c.topic == topic)


def _read(rows: Any) -> dict[int, int]:
    return {int(partition): int(offset) for partition, offset in rows}


def stored(consumer: str, bind: Session | Connection | Engine, topic: str) -> dict[int, int]:
    query = _query(consumer, topic)
    if isinstance(bind, Engine):
        with bind.connect() as connection:
            return _read(connection.execute(query))
    if isinstance(bind, Session | Connection):
        return _read(bind.execute(query))
    raise TypeError(
        f"inbox.stored_offsets() takes a Session, Connection or Engine, got {type(bind).__name__}"
    )


async def stored_async(
    consumer: str, bind: AsyncSession | AsyncConnection | AsyncEngine, topic: str
) -> dict[int, int]:
    from sqlalchemy.ext.asyncio import AsyncEngine

    query = _query(consumer, topic)
    if isinstance(bind, AsyncEngine):
        async with bind.connect() as connection:
            return _read(await connection.execute(query))
    return _read(await bind.execute(query))
