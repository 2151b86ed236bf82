"""A FastAPI service that receives signed webhooks and acts on each exactly once.

    pip install 'sqlalchemy-outbox' fastapi uvicorn aiosqlite   # or asyncpg for PostgreSQL
    export WEBHOOK_SECRET=whsec_... DATABASE_URL=sqlite+aiosqlite:///receiver.db   # the sender's secret
    uvicorn --factory examples.webhook_receiver_fastapi:create_app

A sender's ``WebhookHandler("http://.../hooks/order-paid", secret=...)`` POSTs
each ``order.paid`` event here. The ``WebhookReceiver`` verifies the signature
on the raw body, then takes the request through the inbox with its
``webhook-id`` as the message id: the payment is recorded in one transaction
with the id's marker, and a repeat (an answer lost after the commit, a retry,
an operator's resend) is answered 200 without being recorded again. The
receipt's status code tells the sender whether to stop (2xx) or send again
(500, 503); see docs/webhooks.md.

At start-up the lifespan creates the outbox's tables (the inbox's among them:
what ``outbox migrate`` does; in production make that a deploy step) and the
application's own.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import String
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from outbox import Inbox, InboxMessage
from outbox.integrations.webhook import WebhookReceiver


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payments"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int]
    total: Mapped[str] = mapped_column(String(20))


# --8<-- [start:inbox]
inbox = Inbox("partner_orders")  # stored with every marker: keep it stable


@inbox.handler("order.paid", name="record_payment")
async def record_payment(session: AsyncSession, message: InboxMessage) -> None:
    # In one transaction with the marker of the message's webhook-id: recorded once, however often sent.
    session.add(Payment(order_id=message.payload["order_id"], total=message.payload["total"]))


# --8<-- [end:inbox]


def create_app(database_url: str | None = None, secret: str | None = None) -> FastAPI:
    """The application; ``DATABASE_URL`` and ``WEBHOOK_SECRET`` from the environment unless given."""
    url = database_url or os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///receiver.db")
    engine = outbox.enable_sqlite_savepoints(create_async_engine(url))  # a no-op on PostgreSQL
    Session = async_sessionmaker(engine)
    # --8<-- [start:receive]
    order_paid = WebhookReceiver(  # checks the secret now: a bad one stops the start-up
        inbox, Session, secret=secret or os.environ.get("WEBHOOK_SECRET", ""), event_type="order.paid"
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(outbox.upgrade, engine)  # the inbox's tables; or `outbox migrate`
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/hooks/order-paid")
    async def order_paid_hook(request: Request) -> PlainTextResponse:
        receipt = await order_paid.areceive(await request.body(), request.headers)  # the raw body
        return PlainTextResponse(receipt.reason, status_code=receipt.status_code)

    # --8<-- [end:receive]
    return app
