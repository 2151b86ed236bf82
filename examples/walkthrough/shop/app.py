"""The shop's web application: ``uvicorn shop.app:app``.

It places orders and emits ``order.placed`` in the same transaction. Unless
``SHOP_EMBEDDED_RELAY=0``, its lifespan runs a relay in the application's own
event loop; with ``SHOP_EMBEDDED_RELAY=0``, ``outbox-relay`` delivers instead.
"""

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Annotated

from fastapi import Depends, FastAPI
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from outbox.relay import Relay

from .db import Session, engine
from .events import ob
from .models import Order

# --8<-- [start:logging]
# uvicorn configures only its own loggers: without this, the relay's INFO lines go nowhere.
handler = logging.StreamHandler()
handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
logging.getLogger("outbox").addHandler(handler)
logging.getLogger("outbox").setLevel(logging.INFO)
# --8<-- [end:logging]

EMBEDDED_RELAY = os.environ.get("SHOP_EMBEDDED_RELAY", "1") != "0"


# --8<-- [start:lifespan]
@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    relay = Relay(ob, engine) if EMBEDDED_RELAY else None  # the AsyncEngine: no second URL
    serving = asyncio.create_task(relay.serve(), name="outbox-relay") if relay else None
    try:
        yield
    finally:
        if relay and serving:
            relay.stop()  # stop claiming; deliveries in flight get the grace period
            await serving
        await engine.dispose()


# --8<-- [end:lifespan]


app = FastAPI(lifespan=lifespan)


class OrderIn(BaseModel):
    request_id: str = Field(max_length=64)
    email: str = Field(max_length=255)
    total: Decimal = Field(max_digits=10, decimal_places=2)


async def get_session() -> AsyncIterator[AsyncSession]:
    async with Session() as session:
        yield session


# --8<-- [start:endpoint]
@app.post("/orders", status_code=201)
async def place_order(
    body: OrderIn, session: Annotated[AsyncSession, Depends(get_session)]
) -> dict[str, object]:
    order = Order(request_id=body.request_id, email=body.email, total=body.total)
    session.add(order)
    try:
        await session.flush()  # the order's id, for the payload
    except IntegrityError:  # this request_id was placed already: a retried request
        await session.rollback()
        placed = (
            await session.execute(select(Order).where(Order.request_id == body.request_id))
        ).scalar_one()
        return {"id": placed.id, "request_id": placed.request_id}
    order.emit(
        "order.placed",
        {"order_id": order.id, "email": order.email, "total": str(order.total)},
        key=f"order.placed:{order.request_id}",  # stored once per route, even if this request runs twice
    )
    await session.commit()  # the order and its event, together or not at all
    return {"id": order.id, "request_id": order.request_id}


# --8<-- [end:endpoint]
