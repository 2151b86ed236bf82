"""A Flask service that receives signed webhooks and acts on each exactly once.

    pip install 'sqlalchemy-outbox' flask
    export WEBHOOK_SECRET=whsec_... DATABASE_URL=sqlite:///receiver.db   # or postgresql+psycopg://...
    outbox migrate --database-url "$DATABASE_URL"
    flask --app 'examples.webhook_receiver_flask:create_app(migrate=False)' run

A sender's ``WebhookHandler("http://.../hooks/order-paid", secret=...)`` POSTs
each ``order.paid`` event here. The ``WebhookReceiver`` verifies the signature
on the raw body, then takes the request through the inbox with its
``webhook-id`` as the message id: the payment is recorded in one transaction
with the id's marker, and a repeat (an answer lost after the commit, a retry,
an operator's resend) is answered 200 without being recorded again. The
receipt's status code tells the sender whether to stop (2xx) or send again
(500, 503); see docs/webhooks.md.

The inbox opens its own session from a plain ``sessionmaker`` for each
request. With Flask-SQLAlchemy, give it ``sessionmaker(db.engine)``, not
``db.session``: the inbox owns the transaction from begin to commit.
"""

from __future__ import annotations

import os

from flask import Flask, request
from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

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
def record_payment(session: Session, message: InboxMessage) -> None:
    # In one transaction with the marker of the message's webhook-id: recorded once, however often sent.
    session.add(Payment(order_id=message.payload["order_id"], total=message.payload["total"]))


# --8<-- [end:inbox]


def create_app(database_url: str | None = None, secret: str | None = None, *, migrate: bool = True) -> Flask:
    """The application; ``DATABASE_URL`` and ``WEBHOOK_SECRET`` from the environment unless given."""
    url = database_url or os.environ.get("DATABASE_URL", "sqlite:///receiver.db")
    engine = outbox.enable_sqlite_savepoints(create_engine(url))  # a no-op on PostgreSQL
    if migrate:  # the inbox's tables: what `outbox migrate` does; in production make it a deploy step
        outbox.upgrade(engine)
    Base.metadata.create_all(engine)
    # --8<-- [start:receive]
    order_paid = WebhookReceiver(  # checks the secret now: a bad one stops the start-up
        inbox,
        sessionmaker(engine),
        secret=secret or os.environ.get("WEBHOOK_SECRET", ""),
        event_type="order.paid",
    )
    app = Flask(__name__)

    @app.post("/hooks/order-paid")
    def order_paid_hook() -> tuple[str, int]:
        receipt = order_paid.receive(request.get_data(), request.headers)  # the raw body
        return receipt.reason, receipt.status_code

    # --8<-- [end:receive]
    return app
