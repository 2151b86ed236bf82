"""The operator's actions as the database performs them on PostgreSQL (migration ``outbox_0014``).

Requeue, discard, retry-now, pause and resume call ``SECURITY DEFINER``
functions owned by the tables' owner: each locks what it acts on, checks its
state again under the lock, and writes the history or log row itself, with the
database clock and the login (``session_user``). The operator's role needs
EXECUTE on them and no write grant on the outbox tables, so what these
functions refuse, plain SQL over that login cannot do either. The Python in
the other modules only chooses the candidates and explains refusals; SQLite,
which has no roles, writes the same rows from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import DBAPIError

from ._base import OpsError

__all__ = ["call", "missing_or_forbidden"]

#: SQLSTATEs the functions raise for a refused request: the message says what to do.
_REFUSED = {"55000", "22023", "P0002"}


def missing_or_forbidden(error: DBAPIError, prefix: str, what: str) -> OpsError | None:
    """The one-line error when functions named ``prefix...`` are not there or not granted, else None."""
    state = getattr(error.orig, "sqlstate", None)
    message = str(error.orig)
    if state == "42883" and prefix in message:  # undefined_function: an older schema
        return OpsError(f"this database has no {what} yet: run `outbox migrate` first")
    if state == "42501" and f"function {prefix}" in message:
        return OpsError(
            f"this role may not run the {what}: grant it EXECUTE on them"
            " (docs/operations.md, Least privilege)"
        )
    return None


def call(conn: Connection, statement: str, **params: Any) -> Sequence[Row[Any]]:
    """Run one action function in the caller's transaction; a refusal becomes an :class:`OpsError`."""
    try:
        return conn.execute(text(statement), params).all()
    except DBAPIError as error:
        known = missing_or_forbidden(error, "outbox_", "outbox action functions")
        if known is None and getattr(error.orig, "sqlstate", None) in _REFUSED:
            known = OpsError(str(error.orig).splitlines()[0])
        if known is not None:
            raise known from None
        raise
