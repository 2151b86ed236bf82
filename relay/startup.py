"""The database check a relay makes before it claims anything: one clear line instead of a traceback.

A relay pointed at the wrong database, or at one not yet migrated, would
otherwise fail at its first claim with SQLAlchemy's error text, and keep
retrying as if the database were only down for a moment.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox import OutboxError, outbox_message, outbox_pause
from outbox._migrations import missing_outbox_table

from .run_context import RunContext, first_line

__all__ = ["DatabaseUnavailable", "check_database"]


class DatabaseUnavailable(OutboxError):
    """The relay could not reach its database, or the outbox tables are missing, at start-up."""


async def check_database(rt: RunContext, engine: Engine) -> None:
    """Raise DatabaseUnavailable unless the database answers and has the tables a claim reads."""
    try:
        await rt.db(_probe, engine)
    except SQLAlchemyError as exc:
        url = engine.url.render_as_string(hide_password=True)
        missing = missing_outbox_table(exc)
        if missing is not None:
            raise DatabaseUnavailable(
                f"the outbox tables are missing in {url} (no {missing}): "
                "run `outbox migrate --database-url ...` first"
            ) from None
        raise DatabaseUnavailable(f"cannot reach the database at {url}: {first_line(exc)}") from None


def _probe(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(select(outbox_message.c.id).limit(0))
        # Every claim reads the pauses: a database not migrated that far fails here, in one line.
        conn.execute(select(outbox_pause.c.kind).limit(0))
