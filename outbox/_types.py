"""Column types that behave the same on PostgreSQL and SQLite."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Dialect, Integer
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator

__all__ = ["JSONDocument", "RowId", "UTCDateTime"]

#: 64-bit ids on PostgreSQL; on SQLite only ``INTEGER PRIMARY KEY`` is the rowid,
#: so the variant keeps ids monotonic there too (with ``sqlite_autoincrement``).
RowId = BigInteger().with_variant(Integer(), "sqlite")

#: JSONB on PostgreSQL so operators can query payloads with ``->>``; JSON text elsewhere.
JSONDocument = JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL stores ``timestamptz``. SQLite has no timestamp type, so values are
    kept as naive UTC text (which sorts chronologically) and come back aware, so
    handlers and operators never see a mix of naive and aware datetimes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime, got {type(value).__name__}")
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous here; pass an aware (UTC) datetime")
        aware: datetime = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return aware.replace(tzinfo=None)
        return aware

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)
