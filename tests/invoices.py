"""The small invoice domain the write-path tests commit, and helpers to inspect what was stored."""

from __future__ import annotations

from sqlalchemy import ForeignKey, create_engine, func, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import NullPool

import outbox
from outbox import Outbox, OutboxMixin

m = outbox.outbox_message


class Base(DeclarativeBase):
    pass


class Invoice(OutboxMixin, Base):
    __tablename__ = "invoices"
    id: Mapped[int] = mapped_column(primary_key=True)
    number: Mapped[str]


class Line(Base):
    """Its foreign key is checked at COMMIT, so a bad line fails the COMMIT itself."""

    __tablename__ = "invoice_lines"
    id: Mapped[int] = mapped_column(primary_key=True)
    invoice_id: Mapped[int] = mapped_column(ForeignKey("invoices.id", deferrable=True, initially="DEFERRED"))


def make_outbox(**options: bool) -> Outbox:
    ob = Outbox(**options)
    ob.route("invoice.issued", lambda message: None, name="mail")
    ob.route("invoice.created", lambda message: None, name="created")
    return ob


def stored(engine: Engine) -> tuple[int, int]:
    """(invoices, outbox rows), read on a connection of its own."""
    with engine.connect() as conn:
        invoices = conn.execute(select(func.count()).select_from(Invoice)).scalar_one()
        messages = conn.execute(select(func.count()).select_from(m)).scalar_one()
    return invoices, messages


def add_refuse_bad(engine: Engine) -> None:
    """A real constraint the outbox INSERT of ``{"number": "bad"}`` violates.

    Added on a connection of its own: psycopg forgets its prepared statements
    on a connection that runs ALTER, and the pool's connections keep theirs.
    """
    own = create_engine(engine.url, poolclass=NullPool)
    with own.begin() as conn:
        conn.execute(
            text("ALTER TABLE outbox_message ADD CONSTRAINT refuse_bad CHECK (payload->>'number' <> 'bad')")
        )
    own.dispose()


def take_row_lock(engine: Engine, key: str) -> Connection:
    """Another transaction holds idempotency key ``key``: an INSERT with that key waits on it."""
    blocker = engine.connect()
    blocker.begin()
    blocker.execute(
        text(
            "INSERT INTO outbox_message (event_id, event_type, handler, queue, priority, payload, headers,"
            " idempotency_key, max_attempts, created_at, updated_at, available_at)"
            " VALUES (gen_random_uuid(), 'invoice.issued', 'mail', 'default', 0, '{}', '{}', :k, 1,"
            " now(), now(), now())"
        ),
        {"k": key},
    )
    return blocker
