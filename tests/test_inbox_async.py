"""The inbox with AsyncSessions, on aiosqlite and psycopg's async driver: the same promises, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, func, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session
from test_inbox import effects

import outbox
from outbox import HandlerFailed, Inbox, InboxMessage, Outbox, emit

i, dead, m = outbox.outbox_inbox, outbox.outbox_inbox_dead, outbox.outbox_message
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg_async"}


@pytest.fixture
def async_url(database_url: str) -> Iterator[str]:
    url = make_url(database_url)
    sync = create_engine(url)
    effects.create(sync)
    sync.dispose()
    yield url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()]).render_as_string(hide_password=False)


def run(coroutine_fn: Any, url: str) -> Any:
    async def main() -> Any:
        engine = create_async_engine(url)
        try:
            return await coroutine_fn(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


async def counts(engine: AsyncEngine) -> tuple[int, int, int, int]:
    found = []
    async with engine.connect() as conn:
        for table in (i, effects, m, dead):
            found.append((await conn.execute(select(func.count()).select_from(table))).scalar_one())
    markers, applied, emitted, buried = found
    return markers, applied, emitted, buried


def test_areceive_is_true_once_and_names_its_sync_twin(async_url):
    inbox = Inbox("billing")

    async def scenario(engine: AsyncEngine) -> list[bool]:
        answers = []
        async with AsyncSession(engine) as s, s.begin():
            answers.append(await inbox.areceive(s, "m1"))
            answers.append(await inbox.areceive(s, "m1"))
        async with engine.connect() as conn, conn.begin():
            answers.append(await inbox.areceive(conn, "m1"))
        with pytest.raises(TypeError, match=r"use inbox\.receive"):
            await inbox.areceive(Session(), "m2")  # type: ignore[arg-type]
        return answers

    assert run(scenario, async_url) == [True, False, False]


def test_aprocess_runs_async_and_plain_handlers_in_one_transaction_with_the_marker(async_url):
    ob = Outbox()
    ob.route("invoice.requested", lambda msg: None, name="invoicing")
    inbox = Inbox("billing", max_failures=2)
    broken = {"m2"}

    @inbox.handler("order.paid", name="bill")
    async def bill(session: AsyncSession, message: InboxMessage) -> None:
        await session.execute(insert(effects).values(message_id=message.id, handler="bill"))
        emit(session, "invoice.requested", {"order": message.payload["order"]})

    @inbox.handler("order.#", name="ledger")
    def ledger(session: Session, message: InboxMessage) -> None:  # a plain one gets the sync Session
        session.execute(insert(effects).values(message_id=message.id, handler="ledger"))
        if message.id in broken:
            raise RuntimeError("ledger closed")

    async def scenario(engine: AsyncEngine) -> dict[str, Any]:
        maker = async_sessionmaker(engine)
        ob.install(maker)
        acks: list[str] = []

        async def ack() -> None:
            acks.append("acked")

        out: dict[str, Any] = {}
        out["first"] = (
            await inbox.aprocess(maker, InboxMessage("m1", "order.paid", {"order": 1}), ack=ack)
        ).outcome
        out["again"] = (
            await inbox.aprocess(maker, InboxMessage("m1", "order.paid", {"order": 1}), ack=ack)
        ).outcome
        out["after_m1"] = await counts(engine)
        with pytest.raises(HandlerFailed, match="handler 'ledger' failed"):
            await inbox.aprocess(maker, InboxMessage("m2", "order.paid", {"order": 2}), ack=ack)
        out["after_failure"] = await counts(engine)
        last = await inbox.aprocess(maker, InboxMessage("m2", "order.paid", {"order": 2}, attempt=2), ack=ack)
        out["last"] = (last.outcome, last.dead_letter_id is not None)
        out["after_dead"] = await counts(engine)
        out["acks"] = acks
        async with maker.begin() as s:
            await inbox.astore_offset(s, "orders", 2, 40)
        out["offsets"] = await inbox.astored_offsets(engine, "orders")
        return out

    out = run(scenario, async_url)
    assert (out["first"], out["again"]) == ("handled", "duplicate")
    # (markers, effects, emitted events, dead letters)
    assert out["after_m1"] == (1, 2, 1, 0)
    assert out["after_failure"] == (1, 2, 1, 0)  # marker, both effects and the event rolled back together
    assert out["last"] == ("dead", True)
    assert out["after_dead"] == (2, 2, 1, 1)
    assert out["acks"] == ["acked", "acked", "acked"]
    assert out["offsets"] == {2: 40}
