"""History rows as the relay reported them, without what the database stamps on them itself."""

from __future__ import annotations

from typing import Any


def as_reported(detail: dict[str, Any] | None) -> dict[str, Any] | None:
    """A history row's ``detail`` without ``db_user``, the login PostgreSQL records on every row
    (migration outbox_0015); on SQLite there is none to take away. Empty is None, as reported."""
    if detail is None:
        return None
    reported = {k: v for k, v in detail.items() if k != "db_user"}
    return reported or None
