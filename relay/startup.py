"""The database check a relay makes before it claims anything: one clear line instead of a traceback.

A relay pointed at the wrong database, or at one not yet migrated, would
otherwise fail at its first claim with SQLAlchemy's error text, and keep
retrying as if the database were only down for a moment.
"""

from __future__ import annotations

from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import OutboxError, outbox_message, outbox_pause
from outbox._migrations import missing_outbox_table

from .run_context import RunContext, first_line

__all__ = ["DatabaseUnavailable", "check_database"]


class DatabaseUnavailable(OutboxError):
    """The relay could not reach its database, or the outbox tables are missing, at start-up."""


async def check_database(rt: RunContext, engine: Engine) -> None:
    """Raise DatabaseUnavailable unless the database answers and has the tables a claim reads.

    On PostgreSQL it also looks up where the relay's functions live, so the
    event loop's first claim does not wait on that (``Store.calls``).
    """
    try:
        await rt.db(_probe, engine)
        if rt.store.in_database:
            await rt.db(rt.store.calls)
    except SQLAlchemyError as exc:
        url = engine.url.render_as_string(hide_password=True)
        missing = missing_outbox_table(exc)
        if missing is not None:
            raise DatabaseUnavailable(
                f"the outbox tables are missing in {url} (no {missing}): "
                "run `outbox migrate --database-url ...` first"
            ) from None
        raise DatabaseUnavailable(f"cannot reach the database at {url}: {first_line(exc)}") from None


#: The functions a relay writes through on PostgreSQL (migration outbox_0015).
RELAY_FUNCTIONS = (
    "outbox_claim(text, double precision, text, text[], integer, integer, bigint, boolean)",
    "outbox_complete(text, jsonb)",
    "outbox_extend(text, bigint[], double precision)",
    "outbox_release(text, bigint[], integer[])",
    "outbox_recover(text, jsonb)",
)

_FUNCTIONS = text(
    "SELECT f.signature, to_regprocedure(f.signature) IS NOT NULL,"
    " coalesce(has_function_privilege(to_regprocedure(f.signature), 'EXECUTE'), false), current_user"
    " FROM unnest(CAST(:signatures AS text[])) AS f(signature)"
)


#: Columns this relay reads or writes that later migrations added: where each claim reads a
#: message's expiry (outbox_0018), where an outcome parks a message (outbox_0021).
_NEWER_COLUMNS = ("expires_at", "parked_on")
_COLUMNS = text(
    "SELECT attname FROM pg_attribute WHERE attrelid = CAST(:table AS regclass)"
    " AND attname = ANY(CAST(:names AS text[])) AND NOT attisdropped"
)


def _probe(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(select(outbox_message.c.id).limit(0))
        # Every claim reads the pauses: a database not migrated that far fails here, in one line.
        conn.execute(select(outbox_pause.c.kind).limit(0))
        if engine.dialect.name == "postgresql":
            found = conn.execute(_FUNCTIONS, {"signatures": list(RELAY_FUNCTIONS)}).all()
            params = {"table": "outbox_message", "names": list(_NEWER_COLUMNS)}
            columns = set(conn.execute(_COLUMNS, params).scalars())
        else:
            pragma = conn.exec_driver_sql("SELECT name FROM pragma_table_info('outbox_message')")
            columns = set(pragma.scalars())
    url = engine.url.render_as_string(hide_password=True)
    absent = [name for name in _NEWER_COLUMNS if name not in columns]
    if absent:
        raise DatabaseUnavailable(
            f"the outbox tables in {url} are older than this relay (no outbox_message.{absent[0]}): "
            "run `outbox migrate --database-url ...` first"
        )
    if engine.dialect.name != "postgresql":
        return
    missing = [name for name, exists, _, _ in found if not exists]
    if missing:
        raise DatabaseUnavailable(
            f"the outbox tables in {url} are older than this relay (no {missing[0].split('(')[0]}): "
            "run `outbox migrate --database-url ...` first"
        )
    forbidden = [name.split("(")[0] for name, _, allowed, _ in found if not allowed]
    if forbidden:
        raise DatabaseUnavailable(
            f"the login {found[0][3]} may not execute {', '.join(forbidden)}: run the GRANT statements "
            "of the least-privilege block in docs/operations.md again"
        )
