"""The email sent-log: every Message-ID an SMTP server accepted, so a retry sends nothing twice.

The table lives on its own MetaData (with the outbox naming convention)
because ``outbox`` must not know about its integrations; the ``outbox``
Alembic branch creates it (revision ``outbox_0003``), and
:meth:`SentLog.create_table` does for applications without Alembic.

Rows are written outside the relay's transactions, on purpose: the record must
be durable the moment the server has said 250, whatever happens to the
attempt afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table, Text, delete, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from outbox import ConfigurationError
from outbox._tables import NAMING_CONVENTION
from outbox._types import UTCDateTime

__all__ = ["SentLog", "SentRecord", "email_metadata", "outbox_email_sent"]

#: ``<`` + 32 hex digits + ``@`` + a domain of at most 253 characters + ``>``.
MESSAGE_ID_LENGTH = 320
_RESPONSE_LIMIT = 500

email_metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: Mails an SMTP server accepted, by Message-ID. ``outbox_message_id`` has no foreign key:
#: ``outbox purge`` may delete delivered messages long before the sent-log is trimmed.
outbox_email_sent = Table(
    "outbox_email_sent",
    email_metadata,
    Column("message_id", String(MESSAGE_ID_LENGTH), primary_key=True),
    Column("handler", String(255), nullable=False),
    Column("outbox_message_id", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("accepted_at", UTCDateTime, nullable=False),
    Column("smtp_response", Text),
)


@dataclass(frozen=True, slots=True)
class SentRecord:
    """One accepted mail, as the sent-log remembers it."""

    message_id: str
    handler: str
    outbox_message_id: int
    attempt: int
    accepted_at: datetime
    smtp_response: str | None


class SentLog:
    """The record of accepted mails in the application's database.

    ``SentLog(engine)`` takes a synchronous :class:`~sqlalchemy.engine.Engine`
    (an ``AsyncEngine``'s ``sync_engine`` is used as is). The table comes from
    ``outbox migrate`` (or ``outbox.upgrade(url)``), or from :meth:`create_table`.
    """

    def __init__(self, engine: Engine) -> None:
        sync = getattr(engine, "sync_engine", engine)  # an AsyncEngine wraps the one we need
        if not isinstance(sync, Engine):
            raise ConfigurationError(f"SentLog needs a SQLAlchemy Engine, got {engine!r}")
        self.engine: Engine = sync

    def __repr__(self) -> str:
        return f"<SentLog {self.engine.url.render_as_string(hide_password=True)}>"

    @staticmethod
    def create_table(engine: Engine) -> None:
        """Create ``outbox_email_sent`` if it is missing (for databases not migrated with Alembic)."""
        email_metadata.create_all(getattr(engine, "sync_engine", engine), checkfirst=True)

    def lookup(self, message_id: str) -> SentRecord | None:
        """The record of ``message_id``, or None when no server has accepted it yet."""
        t = outbox_email_sent
        with self.engine.connect() as conn:
            row = conn.execute(select(t).where(t.c.message_id == message_id)).first()
        return None if row is None else SentRecord(**row._asdict())

    def was_sent(self, message_id: str) -> bool:
        return self.lookup(message_id) is not None

    def record(
        self, message_id: str, *, handler: str, outbox_message_id: int, attempt: int, response: str
    ) -> None:
        """Remember that the server accepted ``message_id``; a second record of it is a no-op."""
        values: dict[str, Any] = {
            "message_id": message_id,
            "handler": handler,
            "outbox_message_id": outbox_message_id,
            "attempt": attempt,
            "accepted_at": datetime.now(UTC),
            "smtp_response": response[:_RESPONSE_LIMIT],
        }
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(outbox_email_sent).values(**values))
        except IntegrityError:  # an overlapping attempt of the same message recorded it first
            pass

    def purge(self, before: datetime) -> int:
        """Forget mails accepted before ``before`` (aware datetime); returns how many rows went.

        Only trim what can no longer be retried or re-emitted: a message still
        retrying, or an event emitted again with the same key, whose record is
        gone would be sent again. Keep at least as long as ``outbox purge`` keeps
        delivered messages (their keys are what deduplicates a re-emit).
        """
        with self.engine.begin() as conn:
            result = conn.execute(delete(outbox_email_sent).where(outbox_email_sent.c.accepted_at < before))
        return int(result.rowcount)
