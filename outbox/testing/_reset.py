"""``reset()``: empty the outbox tables of a throwaway test database, history included.

The history tables refuse DELETE and TRUNCATE (triggers installed by the
migrations); that refusal is the audit trail's whole point, and no function
in the schema lifts it. A disposable test database is the one place where
losing history is wanted, so ``reset`` lifts it for itself alone, for the length
of one transaction, and only when told the database is disposable:

- PostgreSQL: as the owner of the tables, ``ALTER TABLE ... DISABLE TRIGGER``
  on the triggers that refuse TRUNCATE (those of the history's partitions too),
  one ``TRUNCATE ... RESTART IDENTITY`` of every outbox table, and the triggers
  enabled again as they were, all in one transaction. Other sessions never see a trigger disabled: the ALTER
  TABLE locks keep their writes waiting until the commit, when the triggers
  are back. A login that does not own the tables is refused, by this code and
  by PostgreSQL.
- SQLite: in one ``BEGIN IMMEDIATE`` transaction, the triggers that refuse
  DELETE are dropped, every outbox table is emptied, its AUTOINCREMENT counter
  reset, and the triggers created again from their own SQL.

The version table (``outbox_alembic_version``) is kept: the schema stays
migrated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from .._exceptions import ConfigurationError
from .._migrations import OUTBOX_TABLES
from .._urls import engine_of, sync_engine

if TYPE_CHECKING:
    from ._binds import Bind

__all__ = ["reset"]

_MODES = {"O": "ENABLE", "A": "ENABLE ALWAYS", "R": "ENABLE REPLICA"}
#: tgtype bit of a TRUNCATE trigger (PostgreSQL's pg_trigger.h).
_TRUNCATE = 32


def reset(bind: Bind, *, disposable: bool = False) -> list[str]:
    """Empty every outbox table of a disposable test database; returns the tables emptied.

    Messages, their delivery history, pauses, breakers, relay registrations,
    purge records, report runs and the email sent-log all go; the schema stays.
    Refused unless ``disposable=True``: this destroys the audit trail the
    database otherwise keeps against everyone. On PostgreSQL it must run as the
    owner of the outbox tables (the login that migrated them). Commit or close
    the test's own sessions first: the reset waits for their locks.
    """
    if disposable is not True:
        raise ConfigurationError(
            "reset() deletes every outbox message and all delivery history, which the database "
            "otherwise refuses to lose; it is for a throwaway test database only: call "
            "reset(engine, disposable=True) to say this database is one"
        )
    given = engine_of(bind)
    engine = sync_engine(given)
    try:
        with engine.connect() as conn:
            present = sorted(OUTBOX_TABLES & set(inspect(conn).get_table_names()))
            if not present:
                raise ConfigurationError(
                    "reset() found no outbox tables in this database (or on its search path): "
                    "migrate it first with outbox.upgrade(engine)"
                )
            conn.rollback()  # the inspection's transaction: the reset takes control of its own
            if conn.dialect.name == "postgresql":
                _reset_postgresql(conn, present)
            elif conn.dialect.name == "sqlite":
                _reset_sqlite(conn, present)
            else:
                raise ConfigurationError(f"reset() supports PostgreSQL and SQLite, not {conn.dialect.name}")
    finally:
        if engine is not given:
            engine.dispose()
    return present


def _reset_postgresql(conn: Connection, tables: list[str]) -> None:
    quote = conn.dialect.identifier_preparer.quote
    with conn.begin():
        owners = conn.execute(
            text(
                "SELECT c.relname, pg_get_userbyid(c.relowner), pg_has_role(c.relowner, 'USAGE')"
                " FROM pg_class c WHERE c.oid = ANY(CAST(:oids AS oid[]))"
            ),
            {"oids": _oids(conn, tables)},
        ).all()
        foreign = sorted({owner for _, owner, mine in owners if not mine})
        if foreign:
            me = conn.execute(text("SELECT current_user")).scalar_one()
            raise ConfigurationError(
                f"reset() must run as the owner of the outbox tables ({', '.join(foreign)}), the only "
                f"login that may lift their append-only triggers; connected as {me}"
            )
        guards = conn.execute(
            text(
                "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname), quote_ident(t.tgname),"
                " t.tgenabled FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                # A partition (outbox_attempt's days, outbox_0024) has a TRUNCATE trigger of its own.
                " WHERE (t.tgrelid = ANY(CAST(:oids AS oid[])) OR t.tgrelid IN (SELECT i.inhrelid"
                " FROM pg_inherits i WHERE i.inhparent = ANY(CAST(:oids AS oid[]))))"
                " AND NOT t.tgisinternal"
                f" AND t.tgtype & {_TRUNCATE} <> 0 AND t.tgenabled <> 'D'"
            ),
            {"oids": _oids(conn, tables)},
        ).all()
        for table, trigger, _ in guards:
            conn.execute(text(f"ALTER TABLE {table} DISABLE TRIGGER {trigger}"))
        conn.execute(text(f"TRUNCATE {', '.join(quote(t) for t in tables)} RESTART IDENTITY"))
        for table, trigger, mode in guards:
            conn.execute(text(f"ALTER TABLE {table} {_MODES[mode]} TRIGGER {trigger}"))


def _oids(conn: Connection, tables: list[str]) -> list[int]:
    quote = conn.dialect.identifier_preparer.quote
    found = conn.execute(
        text("SELECT CAST(to_regclass(t) AS oid) FROM unnest(CAST(:names AS text[])) AS t"),
        {"names": [quote(t) for t in tables]},
    )
    return [oid for (oid,) in found if oid is not None]


def _fires_on_delete(sql: str) -> bool:
    header = re.split(r"\b(?:WHEN|BEGIN)\b", sql, maxsplit=1, flags=re.IGNORECASE)[0]
    return re.search(r"\bDELETE\s+ON\b", header, re.IGNORECASE) is not None


def _reset_sqlite(conn: Connection, tables: list[str]) -> None:
    quote = conn.dialect.identifier_preparer.quote
    # pysqlite begins transactions only before DML, so DROP TRIGGER would commit on its
    # own: take transaction control, and make the whole reset one transaction.
    raw = conn.execution_options(isolation_level="AUTOCOMMIT")
    raw.exec_driver_sql("BEGIN IMMEDIATE")
    try:
        marks = ", ".join("?" for _ in tables)
        guards = [
            (name, sql)
            for name, sql in raw.exec_driver_sql(
                f"SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN ({marks})"
                " ORDER BY rowid",
                tuple(tables),
            )
            if _fires_on_delete(sql)
        ]
        raw.exec_driver_sql("PRAGMA defer_foreign_keys = ON")
        for name, _ in guards:
            raw.exec_driver_sql(f"DROP TRIGGER {quote(name)}")
        for table in tables:
            raw.exec_driver_sql(f"DELETE FROM {quote(table)}")
        if raw.exec_driver_sql("SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").first():
            raw.exec_driver_sql(f"DELETE FROM sqlite_sequence WHERE name IN ({marks})", tuple(tables))
        for _, sql in guards:
            raw.exec_driver_sql(sql)
        raw.exec_driver_sql("COMMIT")
    except BaseException:
        raw.exec_driver_sql("ROLLBACK")
        raise
