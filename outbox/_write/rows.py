"""Turning buffered events into ``outbox_message`` rows, one INSERT per batch.

The INSERT ignores rows whose ``(handler, idempotency_key)`` already exists, so
an idempotency key stores its event once per route across transactions and
concurrent emitters, without raising in the emitter's transaction.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Interval, bindparam, func, inspect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.sql.dml import Insert

from .._exceptions import ConfigurationError, EmitError, OutboxError
from .._tables import outbox_message
from .dedupe import Settle, dropped_indexes, keyed
from .keys import KeyTemplate
from .payload import text_problem
from .pending import PendingEvent

__all__ = ["aggregate_identity", "write_events"]

_CONFLICT = ["handler", "idempotency_key"]
m = outbox_message
#: Width of the aggregate_type and aggregate_id columns.
AGGREGATE_LIMIT = 255


def _postgresql_insert(*, expiring: bool) -> Insert:
    # Timestamps come from the database clock, the same clock the relay's
    # "available_at <= now()" reads, so app-server clock skew cannot delay a
    # wake-up or make a delayed message due early. least() skips NULLs: a route
    # without expires_after leaves the emit's expires_at, and neither leaves NULL.
    now = func.now()
    expiry = (
        {
            "expires_at": func.least(
                bindparam("expires_given", type_=outbox_message.c.expires_at.type),
                now + bindparam("expires_after", type_=Interval()),
            )
        }
        if expiring
        else {}
    )
    return (
        postgresql.insert(outbox_message)
        .values(
            created_at=now,
            updated_at=now,
            available_at=now + bindparam("delay", type_=Interval()),
            **expiry,
        )
        .on_conflict_do_nothing(index_elements=_CONFLICT)
    )


_POSTGRESQL_INSERT = _postgresql_insert(expiring=False)
_POSTGRESQL_EXPIRING_INSERT = _postgresql_insert(expiring=True)
_SQLITE_INSERT = sqlite.insert(outbox_message).on_conflict_do_nothing(index_elements=_CONFLICT)


def aggregate_identity(instance: Any) -> str | None:
    """The aggregate's primary key as text, or None while the database has not assigned it.

    Raises EmitError when the key cannot be stored in the ``aggregate_id``
    column: longer than 255 characters as text, or text PostgreSQL refuses.
    """
    state = inspect(instance)
    # A persistent object's key is in its identity: reading the attributes instead would load an
    # expired object (after a commit), which an AsyncSession refuses outside its greenlet.
    values = state.key[1] if state.key is not None else state.mapper.primary_key_from_instance(instance)
    if any(value is None for value in values):
        return None
    what = f"the primary key of this {type(instance).__name__} (the event's aggregate_id)"
    try:
        identity = ":".join(str(value) for value in values)
    except ValueError:  # an integer past Python's int-to-text digit limit
        raise EmitError(f"{what} is too long to write as text") from None
    if len(identity) > AGGREGATE_LIMIT:
        raise EmitError(
            f"{what} is {len(identity)} characters as text; the column holds {AGGREGATE_LIMIT}. "
            "Emit with outbox.emit() and put the key in the payload instead"
        )
    problem = text_problem(identity)
    if problem:
        raise EmitError(f"{what} {problem}")
    return identity


def _rows(events: list[PendingEvent]) -> list[dict[str, Any]]:
    """One parameter dict per message; ``payload`` is the JSON text emit() checked."""
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
            if event.waits_for_id:
                rows.extend(_filled(row, aggregate_id) for row in event.rows)
                continue
        for row in event.rows:
            rows.append({**row, "aggregate_id": aggregate_id} if event.aggregate is not None else row)
    return rows


def _filled(row: dict[str, Any], aggregate_id: str) -> dict[str, Any]:
    """A row whose key or group key waited for the aggregate's id, with the id filled in."""
    key, group = row["idempotency_key"], row["group_key"]
    return {
        **row,
        "aggregate_id": aggregate_id,
        "idempotency_key": key.render(aggregate_id) if isinstance(key, KeyTemplate) else key,
        "group_key": group.render(aggregate_id) if isinstance(group, KeyTemplate) else group,
    }


_PSYCOPG_COLUMNS = (
    "event_id, event_type, handler, queue, priority, payload, headers, aggregate_type, aggregate_id,"
    " idempotency_key, group_key, max_attempts, created_at, updated_at, available_at"
)
_PSYCOPG_ROW = (
    "(%s, %s, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s, %s, %s, %s,"
    " now(), now(), now() + %s * interval '1 second'"
)
#: A batch with an expiry names the column; one without leaves it out, so an application whose
#: login has the INSERT grant of a guide before outbox_0018 can still emit what does not expire.
_PSYCOPG_EXPIRING_COLUMNS = f"{_PSYCOPG_COLUMNS}, expires_at"
_PSYCOPG_EXPIRY = ", least(%s::timestamptz, now() + %s::float8 * interval '1 second')"


_CONFLICT_SQL = " ON CONFLICT (handler, idempotency_key) DO NOTHING"
_CONFLICT_RETURNING = f"{_CONFLICT_SQL} RETURNING handler, idempotency_key"

#: Rows per INSERT: PostgreSQL binds at most 65,535 parameters per statement (15 a row here).
_ROWS_PER_INSERT = 1000


def _expiring(rows: list[dict[str, Any]]) -> bool:
    return any(row["expires_given"] is not None or row["expires_after"] is not None for row in rows)


def _psycopg_statements(rows: list[dict[str, Any]], *, returning: bool) -> list[tuple[str, tuple[Any, ...]]]:
    """The emitter's hot path: hand-written multi-row INSERTs, no statement compilation.

    This runs inside every emitting request's transaction, so the Python around
    the round trip is kept to string joins and tuples. A commit with thousands
    of events is split, or PostgreSQL's parameter limit would fail it whole.
    ``returning``: a batch with keys asks which rows were stored (``dedupe``).
    """
    return [
        _psycopg_statement(rows[start : start + _ROWS_PER_INSERT], returning=returning)
        for start in range(0, len(rows), _ROWS_PER_INSERT)
    ]


@functools.lru_cache(maxsize=256)
def _psycopg_sql(count: int, *, expiring: bool, returning: bool) -> str:
    """The INSERT's text for ``count`` rows: built once per shape, so each commit only fills parameters.

    The same text object each time also spares psycopg re-hashing it to find its prepared statement.
    """
    columns, row_sql = (
        (_PSYCOPG_EXPIRING_COLUMNS, f"{_PSYCOPG_ROW}{_PSYCOPG_EXPIRY})")
        if expiring
        else (_PSYCOPG_COLUMNS, f"{_PSYCOPG_ROW})")
    )
    return (
        f"INSERT INTO outbox_message ({columns}) VALUES "
        + ", ".join([row_sql] * count)
        + (_CONFLICT_RETURNING if returning else _CONFLICT_SQL)
    )


def _psycopg_statement(rows: list[dict[str, Any]], *, returning: bool) -> tuple[str, tuple[Any, ...]]:
    expiring = _expiring(rows)
    sql = _psycopg_sql(len(rows), expiring=expiring, returning=returning)
    params: list[Any] = []
    for row in rows:
        headers = row["headers"]
        params += (
            row["event_id"],
            row["event_type"],
            row["handler"],
            row["queue"],
            row["priority"],
            row["payload"],
            json.dumps(headers, separators=(",", ":"), ensure_ascii=False) if headers else "{}",
            row["aggregate_type"],
            row["aggregate_id"],
            row["idempotency_key"],
            row["group_key"],
            row["max_attempts"],
            row["delay"].total_seconds(),
        )
        if expiring:
            after = row["expires_after"]
            params += (row["expires_given"], None if after is None else after.total_seconds())
    return sql, tuple(params)


def _psycopg_insert(
    connection: Connection, rows: list[dict[str, Any]], *, pipelined: bool, settle: Settle | None
) -> None:
    # Imported here: applications on SQLite never load psycopg.
    from .pipeline import pipeline_connection, send_in_pipeline

    statements = _psycopg_statements(rows, returning=settle is not None)
    # One statement only: a refusal of the first of several would reach the
    # caller as "pipeline aborted" from the second, hiding its reason.
    raw = pipeline_connection(connection) if pipelined and len(statements) == 1 else None
    if raw is not None:
        send_in_pipeline(connection, raw, *statements[0], on_reply=settle)
        return
    stored: list[Any] = []
    for sql, params in statements:
        result = connection.exec_driver_sql(sql, params)
        if settle is not None:
            stored += result.fetchall()
    if settle is not None:
        settle(len(stored), lambda: stored)


#: What emit() puts in a row that is not a column: SQLite works them out in Python.
_NOT_COLUMNS = ("delay", "expires_given", "expires_after")


def _parsed(row: dict[str, Any], *, expiring: bool) -> dict[str, Any]:
    # Core's JSON type serialises what it is given: hand it a fresh object made from the checked text.
    parsed = {**row, "payload": json.loads(row["payload"])}
    if not expiring:  # the statement without the column binds neither
        del parsed["expires_given"], parsed["expires_after"]
    return parsed


def _sqlite_expiry(row: dict[str, Any], now: datetime) -> datetime | None:
    """The earlier of the emit's expires_at and the route's expires_after from ``now``; None: neither."""
    after = row["expires_after"]
    candidates = [t for t in (row["expires_given"], None if after is None else now + after) if t is not None]
    return min(candidates, default=None)


def _settler(events: list[PendingEvent], rows: list[dict[str, Any]]) -> Settle:
    """What takes the INSERT's answer: the rows it dropped, each remembered on its event."""

    def settle(count: int, stored: Callable[[], Iterable[tuple[Any, Any]]]) -> None:
        if count == len(rows):  # every row stored: the usual answer, and nothing to look at
            return
        owners = [event for event in events for _ in event.rows]  # _rows keeps this order
        for index in dropped_indexes(rows, stored()):
            event = owners[index]
            event.dropped = [*(event.dropped or ()), rows[index]]

    return settle


@functools.cache
def _returning(statement: Insert) -> Insert:
    """The statement asking which rows it stored: made once per statement, as the statements are."""
    return statement.returning(m.c.handler, m.c.idempotency_key)


def _core_insert(
    connection: Connection, statement: Insert, params: list[dict[str, Any]], settle: Settle | None
) -> None:
    """SQLite and PostgreSQL drivers other than psycopg: one executemany, RETURNING when keyed."""
    if settle is None:
        connection.execute(statement, params)
        return
    stored: Sequence[tuple[Any, Any]]
    if connection.dialect.insert_executemany_returning:
        stored = [tuple(r) for r in connection.execute(_returning(statement), params)]
    else:  # a SQLite before 3.35: one row at a time, each answering with its row count
        stored = [
            (p["handler"], p["idempotency_key"]) for p in params if connection.execute(statement, p).rowcount
        ]
    settle(len(stored), lambda: stored)


def write_events(connection: Connection, events: list[PendingEvent], *, pipelined: bool = False) -> None:
    """Store the events' rows in the connection's transaction; remember on each event what was dropped.

    ``pipelined``: this is the commit's own write, which on psycopg may ride
    with the COMMIT (see ``pipeline``); elsewhere it is an ordinary INSERT.
    A row with a key may be dropped as a duplicate: the INSERT then says which
    rows it stored, and ``event.dropped`` lists the others once that answer is
    read (at once, or with the COMMIT's when pipelined).
    """
    for event in events:
        event.dropped = None  # a rewrite (after a savepoint's rollback) decides again
    rows = _rows(events)
    if not rows:
        return
    settle = _settler(events, rows) if keyed(rows) else None
    dialect = connection.dialect.name
    if dialect == "postgresql":
        if connection.dialect.driver == "psycopg":
            _psycopg_insert(connection, rows, pipelined=pipelined, settle=settle)
        else:
            expiring = _expiring(rows)
            _core_insert(
                connection,
                _POSTGRESQL_EXPIRING_INSERT if expiring else _POSTGRESQL_INSERT,
                [_parsed(row, expiring=expiring) for row in rows],
                settle,
            )
    elif dialect == "sqlite":
        now = datetime.now(UTC)
        expiring = _expiring(rows)
        _core_insert(
            connection,
            _SQLITE_INSERT,
            [
                {
                    **{k: v for k, v in row.items() if k not in _NOT_COLUMNS},
                    "payload": json.loads(row["payload"]),
                    "created_at": now,
                    "updated_at": now,
                    "available_at": now + row["delay"],
                    **({"expires_at": _sqlite_expiry(row, now)} if expiring else {}),
                }
                for row in rows
            ],
            settle,
        )
    else:
        raise ConfigurationError(f"the outbox supports PostgreSQL and SQLite, not {dialect!r}")
