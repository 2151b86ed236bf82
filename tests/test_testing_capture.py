"""``outbox.testing.capture()`` in the fixture most suites already have: a transaction per test, rolled back.

Nothing here commits to the database for good: each test runs in a transaction
the fixture rolls back, sessions join it through savepoints (what
``join_transaction_mode="create_savepoint"`` does), and the capture reads
through the test's session or connection. Sync sessions and AsyncSessions, on
SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import String, create_engine
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import NullPool

from outbox import Message, Outbox, OutboxMixin, emit, enable_sqlite_savepoints
from outbox.testing import Capture, Emitted, capture, messages


class Base(DeclarativeBase):
    pass


class Order(OutboxMixin, Base):
    __tablename__ = "capture_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    reference: Mapped[str] = mapped_column(String(50))


def _deliver(msg: Message) -> None:
    pass


def shop() -> Outbox:
    ob = Outbox()
    ob.route("order.placed", _deliver, name="ledger")
    ob.route("order.placed", _deliver, name="mailer", queue="mail", transform=lambda p: {"ref": p["ref"]})
    ob.route("order.cancelled", _deliver, name="ledger_cancel")
    return ob


def place(session: Session, ref: str, *, total: int = 10) -> Order:
    """Application code: it adds an order and emits; whether it commits is up to the caller."""
    order = Order(reference=ref)
    session.add(order)
    order.emit("order.placed", {"ref": ref, "total": total}, key=f"order.placed:{ref}")
    return order


def committed(engine: Engine) -> list[Any]:
    """What another connection sees."""
    return messages(engine)


@pytest.fixture
def engine(engine: Engine) -> Engine:
    Base.metadata.create_all(engine)
    return engine


@pytest.fixture
def connection(engine: Engine) -> Iterator[Connection]:
    """The test's connection: one transaction, rolled back whatever the test did."""
    # Savepoints on SQLite, as the sessions below need, on an engine of the fixture's own.
    rollback_engine = enable_sqlite_savepoints(create_engine(engine.url))
    with rollback_engine.connect() as conn:
        outer = conn.begin()
        yield conn
        outer.rollback()
    rollback_engine.dispose()


@pytest.fixture
def ob() -> Outbox:
    return shop()


@pytest.fixture
def sessions(connection: Connection, ob: Outbox) -> Iterator[sessionmaker[Session]]:
    """Sessions on the test's connection: their commits release a savepoint, the fixture rolls back."""
    factory = sessionmaker(bind=connection, join_transaction_mode="create_savepoint")
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as s:
        yield s


def test_what_the_test_emitted_without_committing(session, engine):
    with capture(session) as cap:
        order = place(session, "A-1")  # no flush, no commit: capture writes what the commit would
    rows = cap.assert_emitted("order.placed", payload={"ref": "A-1", "total": 10}, count=1)
    assert [r.handler for r in rows] == ["ledger"], "the payload is matched per route, as stored"
    assert [r.payload for r in cap.messages(handler="mailer")] == [{"ref": "A-1"}]
    assert cap.payloads("order.placed") == [{"ref": "A-1", "total": 10}]
    assert order.id is not None and {r.aggregate_id for r in cap.messages()} == {str(order.id)}
    assert {r.idempotency_key for r in cap.messages()} == {"order.placed:A-1"}
    cap.assert_emitted("order.placed", key="order.placed:A-1")
    assert committed(engine) == [], "nothing is committed: other connections see nothing"


def test_application_commits_release_savepoints_and_the_capture_still_sees_them(sessions, connection):
    with capture(connection) as cap:
        with sessions.begin() as s:  # what the application's own code does
            place(s, "A-1")
        with sessions.begin() as s:
            place(s, "A-2")
            emit(s, "order.cancelled", {"ref": "A-1"})
    assert cap.event_types() == ["order.placed", "order.placed", "order.cancelled"]
    assert cap.payloads("order.placed") == [{"ref": "A-1", "total": 10}, {"ref": "A-2", "total": 10}]
    assert len(cap.messages()) == 5, "one row per route"
    assert [e.event_type for e in cap.emitted] == cap.event_types()


def test_a_rolled_back_savepoint_is_emitted_but_not_stored(session):
    with capture(session) as cap:
        place(session, "kept")
        savepoint = session.begin_nested()
        emit(session, "order.cancelled", {"ref": "kept"})
        savepoint.rollback()
    assert [e.event_type for e in cap.emitted] == ["order.placed", "order.cancelled"]
    assert isinstance(cap.emitted[0], Emitted) and cap.emitted[0].routes == ("ledger", "mailer")
    assert cap.event_types() == ["order.placed"]
    with pytest.raises(AssertionError) as missing:
        cap.assert_emitted("order.cancelled")
    said = str(missing.value)
    assert "expected some 'order.cancelled' event(s), found 0" in said
    assert "stored event types: ['order.placed']" in said
    assert "emitted but not stored: ['order.cancelled'] (rolled back" in said


def test_a_repeated_key_is_one_event_twice_emitted(session):
    with capture(session) as cap:
        place(session, "A-1")
        session.flush()
        emit(session, "order.placed", {"ref": "A-1", "total": 99}, key="order.placed:A-1")
    assert len(cap.emitted) == 2
    cap.assert_emitted("order.placed", count=1, payload={"ref": "A-1", "total": 10})
    with pytest.raises(AssertionError, match="expected 2 'order.placed' event"):
        cap.assert_emitted("order.placed", count=2)


def test_only_what_the_block_emitted(session):
    place(session, "before")
    with capture(session) as cap:
        cap.assert_nothing_emitted()
        place(session, "inside")
        assert cap.payloads("order.placed") == [{"ref": "inside", "total": 10}], "readable inside the block"
    place(session, "after")
    assert cap.payloads("order.placed") == [{"ref": "inside", "total": 10}]
    with pytest.raises(AssertionError, match=r"expected no stored events, found \['order.placed'\]"):
        cap.assert_nothing_emitted()
    with pytest.raises(TypeError, match="no column 'colour'"):
        cap.messages(colour="red")


def test_statuses_are_read_at_each_question(engine, ob):
    """On an engine the capture reads committed rows, as they are when asked."""
    from outbox.testing import drain

    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with capture(engine) as cap:
            done = threading.Event()

            def in_a_server_thread() -> None:  # an app under test may emit from another thread
                with factory.begin() as s:
                    place(s, "T-1")
                done.set()

            threading.Thread(target=in_a_server_thread).start()
            assert done.wait(30)
        assert {r.status for r in cap.messages()} == {"pending"}
        assert drain(ob, engine).delivered == 2
        assert {r.status for r in cap.messages()} == {"delivered"}
    finally:
        ob.uninstall(factory)


# -- async ------------------------------------------------------------------------------------------


def async_url(engine: Engine) -> str:
    url = engine.url
    driver = "sqlite+aiosqlite" if url.get_backend_name() == "sqlite" else "postgresql+asyncpg"
    return make_url(url).set(drivername=driver).render_as_string(hide_password=False)


def in_a_rolled_back_async_transaction(engine: Engine, ob: Outbox, test: Any) -> Any:
    """Run ``test(session)`` as an async suite's fixture would: AsyncSession on a rolled-back connection."""

    async def scenario() -> Any:
        app_engine = enable_sqlite_savepoints(create_async_engine(async_url(engine), poolclass=NullPool))
        try:
            async with app_engine.connect() as conn:
                outer = await conn.begin()
                factory = async_sessionmaker(bind=conn, join_transaction_mode="create_savepoint")
                ob.install(factory)
                try:
                    async with factory() as session:
                        return await test(session)
                finally:
                    ob.uninstall(factory)
                    await outer.rollback()
        finally:
            await app_engine.dispose()

    return asyncio.run(scenario())


def test_async_with_reads_the_async_session_when_the_block_ends(engine, ob):
    async def test(session: AsyncSession) -> Capture:
        async with capture(session) as cap:
            await session.run_sync(place, "A-1")  # the application's async code, no commit
            with pytest.raises(RuntimeError, match=r"1 event\(s\) were emitted since it last read"):
                cap.event_types()
            await cap.refresh()
            assert cap.event_types() == ["order.placed"]
            emit(session, "order.cancelled", {"ref": "A-1"})
            with pytest.raises(RuntimeError, match="`await cap.refresh\\(\\)` first"):
                cap.messages()
        return cap

    cap = in_a_rolled_back_async_transaction(engine, ob, test)
    assert cap.event_types() == ["order.placed", "order.cancelled"]
    cap.assert_emitted("order.placed", payload={"ref": "A-1", "total": 10}, count=1)
    assert committed(engine) == []


def test_async_commits_release_savepoints_and_rollbacks_discard(engine, ob):
    async def test(session: AsyncSession) -> Capture:
        async with capture(session) as cap:
            await session.run_sync(place, "A-1")
            await session.commit()
            async with session.begin_nested() as savepoint:
                emit(session, "order.cancelled", {"ref": "A-1"})
                await savepoint.rollback()
        return cap

    cap = in_a_rolled_back_async_transaction(engine, ob, test)
    assert cap.event_types() == ["order.placed"]
    assert [e.event_type for e in cap.emitted] == ["order.placed", "order.cancelled"]
    assert committed(engine) == []


def test_a_capture_started_without_async_with_reads_at_refresh(engine, ob):
    """The pytest plugin's fixture opens the capture synchronously; the test refreshes it."""

    async def test(session: AsyncSession) -> list[str]:
        cap = capture(session).start()
        try:
            emit(session, "order.cancelled", {"ref": "X"})
            await cap.refresh()
            return cap.event_types()
        finally:
            cap.stop()

    assert in_a_rolled_back_async_transaction(engine, ob, test) == ["order.cancelled"]
