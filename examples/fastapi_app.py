"""A FastAPI application with an embedded relay: one async URL, emit in the request, delivery beside it.

    pip install 'sqlalchemy-outbox' fastapi uvicorn aiosqlite   # or asyncpg for PostgreSQL
    DATABASE_URL=sqlite+aiosqlite:///fastapi_app.db uvicorn examples.fastapi_app:app
    curl -X POST localhost:8000/signups -H 'content-type: application/json' -d '{"email": "a@example.com"}'

``DATABASE_URL`` is the application's async URL (default: an aiosqlite file
in the working directory; ``postgresql+asyncpg://...`` or
``postgresql+psycopg_async://...`` for PostgreSQL). The relay is given the same
``AsyncEngine`` and connects through the matching synchronous driver with the
engine's settings (see docs/frameworks.md).

At start-up the lifespan migrates the outbox tables (what ``outbox migrate``
does; in production run that as a deploy step instead) and starts
``relay.serve()`` as a task in the application's own event loop; at shutdown it
stops the relay gracefully. Each delivery appends a JSON line to the file named
by ``DELIVERIES_FILE`` (default ``deliveries.jsonl``), standing in for an email.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel
from sqlalchemy import String
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import outbox
from outbox import Message, Outbox, emit
from outbox.relay import Relay

DATABASE_URL = os.environ.get("DATABASE_URL", "sqlite+aiosqlite:///fastapi_app.db")
DELIVERIES_FILE = Path(os.environ.get("DELIVERIES_FILE", "deliveries.jsonl"))

# On SQLite: transactional savepoints, WAL and a busy timeout (a no-op on PostgreSQL).
engine = outbox.enable_sqlite_savepoints(create_async_engine(DATABASE_URL))
Session = async_sessionmaker(engine, expire_on_commit=False)

ob = Outbox()
ob.install(Session)


class Base(DeclarativeBase):
    pass


class Signup(Base):
    __tablename__ = "signups"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(255), unique=True)


@ob.handler("user.signed_up", name="welcome_email", max_attempts=5)
def send_welcome(msg: Message) -> None:
    # A plain function runs on a relay thread, never blocking the application's loop.
    with DELIVERIES_FILE.open("a") as out:
        out.write(json.dumps({"message_id": msg.id, "attempt": msg.attempt, **msg.payload}) + "\n")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await asyncio.to_thread(outbox.upgrade, engine)  # blocking Alembic work: off the loop
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    relay = Relay(ob, engine)
    serving = asyncio.create_task(relay.serve(), name="outbox-relay")
    app.state.relay = relay
    try:
        yield
    finally:
        relay.stop()  # stop claiming; in-flight deliveries get the grace period
        await serving
        await engine.dispose()


app = FastAPI(lifespan=lifespan)


class SignupIn(BaseModel):
    email: str


@app.post("/signups", status_code=201)
async def sign_up(body: SignupIn) -> dict[str, object]:
    async with Session() as session, session.begin():
        user = Signup(email=body.email)
        session.add(user)
        await session.flush()  # the id, for the payload
        event_id = emit(
            session, "user.signed_up", {"user_id": user.id, "email": body.email}, key=f"signup:{body.email}"
        )
    # Committed: the row and the event together. The embedded relay wakes at once.
    return {"id": user.id, "event_id": str(event_id)}
