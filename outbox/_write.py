"""Turning buffered events into ``outbox_message`` rows, one INSERT per batch.

The INSERT ignores rows whose ``(handler, idempotency_key)`` already exists, so
an idempotency key stores its event once per route across transactions and
concurrent emitters, without raising in the emitter's transaction.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Interval, bindparam, func, inspect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from ._exceptions import ConfigurationError, OutboxError
from ._pending import PendingEvent
from ._tables import outbox_message

__all__ = ["aggregate_identity", "write_events"]

_CONFLICT = ["handler", "idempotency_key"]


def _postgresql_insert() -> Insert:
    # Timestamps come from the database clock, the same clock the relay's
    # "available_at <= now()" reads, so app-server clock skew cannot delay a
    # wake-up or make a delayed message due early.
    now = func.now()
    return (
        postgresql.insert(outbox_message)
        .values(
            created_at=now,
            updated_at=now,
            available_at=now + bindparam("delay", type_=Interval()),
        )
        .on_conflict_do_nothing(index_elements=_CONFLICT)
    )


_POSTGRESQL_INSERT = _postgresql_insert()
_SQLITE_INSERT = sqlite.insert(outbox_message).on_conflict_do_nothing(index_elements=_CONFLICT)


def aggregate_identity(instance: Any) -> str | None:
    """The aggregate's primary key as text, or None while the database has not assigned it."""
    state = inspect(instance)
    values = state.mapper.primary_key_from_instance(instance)
    if any(value is None for value in values):
        return None
    return ":".join(str(value) for value in values)


def _rows(events: list[PendingEvent]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for event in events:
        aggregate_id = None
        if event.aggregate is not None:
            aggregate_id = aggregate_identity(event.aggregate)
            if aggregate_id is None:
                raise OutboxError(
                    f"event {event.event_id} was emitted by a {type(event.aggregate).__name__} "
                    "that was never flushed (was it expunged from the session?); its id is unknown"
                )
        for row in event.rows:
            rows.append({**row, "aggregate_id": aggregate_id} if event.aggregate is not None else row)
    return rows


def write_events(connection: Connection, events: list[PendingEvent]) -> None:
    rows = _rows(events)
    if not rows:
        return
    dialect = connection.dialect.name
    if dialect == "postgresql":
        connection.execute(_POSTGRESQL_INSERT, rows)
    elif dialect == "sqlite":
        now = datetime.now(UTC)
        connection.execute(
            _SQLITE_INSERT,
            [
                {
                    **{k: v for k, v in row.items() if k != "delay"},
                    "created_at": now,
                    "updated_at": now,
                    "available_at": now + row["delay"],
                }
                for row in rows
            ],
        )
    else:
        raise ConfigurationError(
            f"the outbox supports PostgreSQL and SQLite, not {dialect!r}"
        )
