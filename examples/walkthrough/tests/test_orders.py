"""What placing an order emits, checked inside a rolled-back transaction: no relay, no broker, no mail."""

import uuid

import pytest

from outbox.testing import capture

pytestmark = pytest.mark.anyio


# --8<-- [start:tests]
def an_order() -> dict[str, str]:
    return {"request_id": f"test-{uuid.uuid4()}", "email": "ada@example.com", "total": "12.50"}


async def test_placing_an_order_emits_order_placed_once_per_route(client, session):
    async with capture(session) as cap:
        response = await client.post("/orders", json=an_order())
    assert response.status_code == 201
    order_id = response.json()["id"]
    payloads = {row.handler: row.payload for row in cap.messages(event_type="order.placed")}
    assert payloads == {
        "order_confirmation": {
            "to": "ada@example.com",
            "subject": f"Order {order_id} confirmed",
            "text": "Thank you! We received your order of 12.50.",
        },
        "partner_webhook": {"order_id": order_id, "total": "12.50"},  # no email address leaves
        "orders_rabbit": {"order_id": order_id, "total": "12.50"},
    }


async def test_a_retried_request_places_one_order_and_emits_once(client, session):
    order = an_order()
    async with capture(session) as cap:
        first = await client.post("/orders", json=order)
        again = await client.post("/orders", json=order)  # the client did not see the first answer
    assert again.json() == first.json()
    cap.assert_emitted("order.placed", key=f"order.placed:{order['request_id']}", count=1)


# --8<-- [end:tests]
