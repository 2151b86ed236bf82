"""The documented SQLite set-up takes concurrent writers and a running relay without "database is locked".

Each request reads before it writes (as ORM code does: a lookup, then an insert
and an emit), inside a savepoint too, so transactions that began as readers
must become writers while others write.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from sqlalchemy import Integer, String, create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import Message, Outbox, emit, enable_sqlite_savepoints
from outbox.relay import Relay

WRITERS = 6
REQUESTS = 15


class Base(DeclarativeBase):
    pass


class Ticket(Base):
    __tablename__ = "tickets"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    title: Mapped[str] = mapped_column(String(50))


def _outbox(delivered: list[int]) -> Outbox:
    ob = Outbox()

    @ob.handler("ticket.opened", name="ticket_opened")
    def opened(message: Message) -> None:
        delivered.append(message.payload["n"])

    return ob


def _prepare(path: Path) -> str:
    url = f"sqlite:///{path}"
    outbox.upgrade(url)
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    return url


def _open_ticket(session: Session, n: int) -> None:
    session.execute(select(func.count()).select_from(Ticket)).scalar_one()  # read first
    with session.begin_nested():
        session.add(Ticket(title=f"t{n}"))
        session.flush()
        emit(session, "ticket.opened", {"n": n}, key=f"ticket:{n}")


def test_threads_and_a_relay_share_a_sqlite_file(tmp_path: Path) -> None:
    url = _prepare(tmp_path / "app.db")
    delivered: list[int] = []
    ob = _outbox(delivered)
    engine = enable_sqlite_savepoints(create_engine(url))
    sessions = sessionmaker(engine)
    ob.install(sessions)
    relay = Relay(ob, url, poll_interval=0.05)
    serving = threading.Thread(target=relay.run)
    serving.start()
    failures: list[BaseException] = []

    def requests(worker: int) -> None:
        try:
            for i in range(REQUESTS):
                with sessions.begin() as session:
                    _open_ticket(session, worker * 1000 + i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    try:
        workers = [threading.Thread(target=requests, args=(w,)) for w in range(WRITERS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert failures == [], failures[:1]
        relay_done = Relay(ob, url).run_until_idle  # whatever the serving relay has not finished yet
    finally:
        relay.stop()
        serving.join(30)
    relay_done()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Ticket)).scalar_one() == WRITERS * REQUESTS
        statuses = conn.execute(
            select(outbox.outbox_message.c.status, func.count()).group_by(outbox.outbox_message.c.status)
        ).all()
    assert dict(statuses) == {"delivered": WRITERS * REQUESTS}
    assert sorted(set(delivered)) == sorted(w * 1000 + i for w in range(WRITERS) for i in range(REQUESTS))
    engine.dispose()


@pytest.mark.parametrize("requests", [3, 12])
def test_asyncio_gathered_requests_on_aiosqlite(tmp_path: Path, requests: int) -> None:
    url = _prepare(tmp_path / "app.db")
    ob = _outbox([])

    async def main() -> None:
        engine = enable_sqlite_savepoints(create_async_engine(url.replace("sqlite", "sqlite+aiosqlite", 1)))
        sessions = async_sessionmaker(engine, class_=AsyncSession)
        ob.install(sessions)

        async def request(n: int) -> None:
            async with sessions.begin() as session:
                await session.run_sync(_open_ticket, n)
                await asyncio.sleep(0.01)  # the others run meanwhile, holding their transactions

        try:
            for _ in range(3):
                await asyncio.gather(*(request(n) for n in range(requests)))
                async with sessions() as session:
                    await session.execute(select(func.count()).select_from(Ticket))
        finally:
            await engine.dispose()

    # Three rounds of the same keys: each round stores its tickets; the keys keep one event each.
    asyncio.run(main())
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Ticket)).scalar_one() == 3 * requests
        assert conn.execute(select(func.count()).select_from(outbox.outbox_message)).scalar_one() == requests
    engine.dispose()
