"""The shop's Outbox: what happens after an order is placed. ``outbox-relay --app shop.events:ob`` serves it.

Settings come from the environment (docs/walkthrough.md lists them); every
handler checks its own when this module is imported, so a bad setting stops
the application and the relay at start-up.
"""

import os

from outbox import Outbox
from outbox.integrations.email import EmailHandler
from outbox.integrations.rabbitmq import RabbitMQPublisher
from outbox.integrations.webhook import WebhookHandler

from .db import Session

# --8<-- [start:routes]
ob = Outbox()
ob.install(Session)  # the app's async_sessionmaker: its sessions can emit


def confirmation(order: dict) -> dict:
    """What the email handler needs: recipients, subject and body."""
    return {
        "to": order["email"],
        "subject": f"Order {order['order_id']} confirmed",
        "text": f"Thank you! We received your order of {order['total']}.",
    }


def public(order: dict) -> dict:
    """What leaves the company: never the customer's address."""
    return {"order_id": order["order_id"], "total": order["total"]}


ob.route(
    "order.placed",
    EmailHandler(os.environ["SMTP_HOST"], int(os.environ["SMTP_PORT"]), sender="Shop <shop@example.com>"),
    name="order_confirmation",
    transform=confirmation,
    max_attempts=8,
)
ob.route(
    "order.placed",
    WebhookHandler(
        os.environ["PARTNER_WEBHOOK_URL"],
        secret=os.environ["PARTNER_WEBHOOK_SECRET"],
        allowed_networks=["127.0.0.0/8"],  # the partner runs on this machine here; drop it for a public URL
    ),
    name="partner_webhook",
    transform=public,
    max_attempts=10,
)
ob.route(
    "order.placed",
    RabbitMQPublisher(
        os.environ["RABBITMQ_URL"],
        exchange="shop.orders",
        routing_key="{event_type}",
        declare_exchange="topic",
    ),
    name="orders_rabbit",
    transform=public,
)
# --8<-- [end:routes]
