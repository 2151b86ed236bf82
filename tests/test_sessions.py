"""Sessions the outbox can be installed on, sync and async, on real SQLite and PostgreSQL.

Every install target (a Session subclass, a sessionmaker, a scoped_session, the
AsyncSession class, an async_sessionmaker, an async_scoped_session, a
``sessionmaker(class_=AsyncSession)``) must store
one ``outbox_message`` row per route when the transaction commits, nothing when
it rolls back, and nothing more after a second install; after ``uninstall`` an
emit is refused. Async sessions are driven with ``asyncio.run`` inside plain
tests, so no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import String, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, scoped_session, sessionmaker
from sqlalchemy.pool import NullPool

import outbox
from outbox import ConfigurationError, NotInstalled, Outbox, OutboxMixin, UnroutedEvent, emit, signals

m = outbox.outbox_message

SYNC_KINDS = ("session_subclass", "sessionmaker", "scoped_session")
ASYNC_KINDS = (
    "async_session_class",
    "async_sessionmaker",
    "async_scoped_session",
    "sessionmaker_of_async_sessions",  # the SQLAlchemy 1.4 spelling, still common
)
#: Every target except the AsyncSession class, whose sessions run on the global Session class.
FACTORY_KINDS = tuple(k for k in SYNC_KINDS + ASYNC_KINDS if k != "async_session_class")


class Base(DeclarativeBase):
    pass


class Order(OutboxMixin, Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    reference: Mapped[str] = mapped_column(String(50))


class _Rollback(Exception):
    """Raised inside ``with session.begin()`` to leave it by rolling back."""


def _deliver(msg: outbox.Message) -> None:
    pass


def order_outbox() -> Outbox:
    """Two routes for ``order.paid`` in different queues, so every emit fans out to two rows."""
    ob = Outbox()
    ob.route("order.paid", _deliver, name="audit")
    ob.route("order.paid", _deliver, name="ledger", queue="ledger")
    return ob


def stored(engine: Engine) -> list[tuple[str, Any]]:
    """(handler, payload) of every stored message, in a stable order."""
    with engine.connect() as conn:
        return [(r.handler, r.payload) for r in conn.execute(select(m).order_by(m.c.handler, m.c.id))]


def order_ids(engine: Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.scalars(select(Order.id).order_by(Order.id)))


def fanned_out(*payloads: dict[str, Any]) -> list[tuple[str, Any]]:
    """What ``stored`` returns after ``order.paid`` was committed once per payload."""
    return [("audit", p) for p in payloads] + [("ledger", p) for p in payloads]


def async_url(database_url: str) -> str:
    url = make_url(database_url)
    driver = "sqlite+aiosqlite" if url.get_backend_name() == "sqlite" else "postgresql+psycopg"
    return url.set(drivername=driver).render_as_string(hide_password=False)


@pytest.fixture
def schema(engine: Engine) -> Engine:
    Base.metadata.create_all(engine)
    return engine


@pytest.fixture
def async_engine(database_url: str) -> Iterator[AsyncEngine]:
    # NullPool: each asyncio.run() has its own event loop, and a pooled async
    # connection must not outlive the loop it was opened on.
    eng = create_async_engine(async_url(database_url), poolclass=NullPool)
    yield eng
    asyncio.run(eng.dispose())


class Harness:
    """One install target, and a way to run a transaction in a session it makes."""

    def __init__(self, kind: str, engine: Engine, async_engine: AsyncEngine) -> None:
        self.kind = kind
        self.is_async = kind in ASYNC_KINDS
        self.target: Any
        self.open: Callable[[], Any]
        self.cleanup: Callable[[], Any] | None = None
        if kind == "session_subclass":
            cls = type("AppSession", (Session,), {})
            self.target, self.open = cls, lambda: cls(engine)
        elif kind == "sessionmaker":
            self.target = self.open = sessionmaker(engine)
        elif kind == "scoped_session":
            scoped = scoped_session(sessionmaker(engine))
            self.target, self.open, self.cleanup = scoped, scoped, scoped.remove
        elif kind == "async_session_class":
            self.target, self.open = AsyncSession, lambda: AsyncSession(async_engine)
        elif kind == "async_sessionmaker":
            self.target = self.open = async_sessionmaker(async_engine)
        elif kind == "async_scoped_session":
            ascoped = async_scoped_session(async_sessionmaker(async_engine), scopefunc=asyncio.current_task)
            self.target, self.open, self.cleanup = ascoped, ascoped, ascoped.remove
        elif kind == "sessionmaker_of_async_sessions":
            self.target = self.open = sessionmaker(async_engine, class_=AsyncSession)  # type: ignore[call-overload]
        else:  # pragma: no cover
            raise AssertionError(kind)

    def transaction(
        self, *payloads: dict[str, Any], event_type: str = "order.paid", commit: bool = True
    ) -> list[uuid.UUID]:
        """Emit ``event_type`` once per payload inside one transaction, then commit or roll back."""
        if self.is_async:
            return asyncio.run(self._async_transaction(payloads, event_type, commit))
        ids: list[uuid.UUID] = []
        session = self.open()
        try:
            with session.begin():
                ids.extend(emit(session, event_type, p) for p in payloads)
                if not commit:
                    raise _Rollback
        except _Rollback:
            pass
        finally:
            session.close()
            if self.cleanup is not None:
                self.cleanup()
        return ids

    async def _async_transaction(
        self, payloads: tuple[dict[str, Any], ...], event_type: str, commit: bool
    ) -> list[uuid.UUID]:
        ids: list[uuid.UUID] = []
        session = self.open()
        try:
            async with session.begin():
                ids.extend(emit(session, event_type, p) for p in payloads)
                if not commit:
                    raise _Rollback
        except _Rollback:
            pass
        finally:
            await session.close()
            if self.cleanup is not None:
                await self.cleanup()
        return ids


@pytest.fixture(params=SYNC_KINDS + ASYNC_KINDS)
def installed(request: pytest.FixtureRequest, schema: Engine, async_engine: AsyncEngine) -> Iterator[Any]:
    """(outbox, harness) with the outbox installed twice on the harness's target."""
    ob = order_outbox()
    harness = Harness(request.param, schema, async_engine)
    ob.install(harness.target)
    ob.install(harness.target)  # harmless
    yield ob, harness
    try:
        ob.uninstall(harness.target)
    except ConfigurationError:  # the test uninstalled it already
        pass


@contextmanager
def received(signal: Any, sender: Any) -> Iterator[list[dict[str, Any]]]:
    """Collect the keyword arguments of every send of ``signal`` by ``sender``."""
    calls: list[dict[str, Any]] = []

    def receiver(sent_by: Any, **kwargs: Any) -> None:
        assert sent_by is sender
        calls.append(kwargs)

    with signal.connected_to(receiver, sender=sender):
        yield calls


# -- every install target -----------------------------------------------------


def test_commit_stores_one_row_per_route_even_when_installed_twice(installed, engine):
    ob, harness = installed
    with (
        received(signals.event_emitted, ob) as emitted,
        received(signals.messages_committed, ob) as committed,
    ):
        harness.transaction({"n": 1}, {"n": 2})
    assert stored(engine) == fanned_out({"n": 1}, {"n": 2})
    assert len(emitted) == 2
    assert len(committed) == 1


def test_rollback_stores_nothing(installed, engine):
    ob, harness = installed
    with received(signals.messages_committed, ob) as committed:
        harness.transaction({"n": 1}, commit=False)
        assert stored(engine) == []
        assert committed == []
        harness.transaction({"n": 2})
    assert stored(engine) == fanned_out({"n": 2})


def test_uninstall_stops_storage(installed, engine):
    ob, harness = installed
    harness.transaction({"before": 1})
    ob.uninstall(harness.target)
    with pytest.raises(NotInstalled, match="install"):
        harness.transaction({"after": 1})
    assert stored(engine) == fanned_out({"before": 1})
    ob.install(harness.target)
    harness.transaction({"again": 1})
    assert stored(engine) == fanned_out({"before": 1}, {"again": 1})


@pytest.mark.parametrize("kind", FACTORY_KINDS)
def test_install_reaches_only_the_sessions_its_target_makes(kind, schema, engine, async_engine):
    ob = order_outbox()
    harness = Harness(kind, engine, async_engine)
    ob.install(harness.target)
    try:
        harness.transaction({"n": 1})
        bystanders = [Harness(k, engine, async_engine) for k in FACTORY_KINDS]
        bystanders.append(Harness("async_session_class", engine, async_engine))  # plain Session inside
        for bystander in bystanders:
            with pytest.raises(NotInstalled):
                bystander.transaction({"n": 2})
        with Session(engine) as plain, pytest.raises(NotInstalled):
            emit(plain, "order.paid", {"n": 3})
    finally:
        ob.uninstall(harness.target)
    assert stored(engine) == fanned_out({"n": 1})


# -- several outboxes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("shop_kind", "billing_kind"),
    [
        ("sessionmaker", "async_sessionmaker"),
        ("session_subclass", "scoped_session"),
        ("async_scoped_session", "sessionmaker_of_async_sessions"),
    ],
)
def test_two_outboxes_on_two_factories_each_write_only_their_own_routes(
    shop_kind, billing_kind, schema, engine, async_engine
):
    shop, billing = Outbox(), Outbox()
    shop.route("order.paid", _deliver, name="shop_audit")
    billing.route("invoice.sent", _deliver, name="billing_mail")
    billing.route("invoice.sent", _deliver, name="billing_archive", queue="archive")
    shop_sessions = Harness(shop_kind, engine, async_engine)
    billing_sessions = Harness(billing_kind, engine, async_engine)
    shop.install(shop_sessions.target)
    billing.install(billing_sessions.target)
    try:
        shop_sessions.transaction({"from": "shop"})
        billing_sessions.transaction({"from": "billing"}, event_type="invoice.sent")
        with pytest.raises(UnroutedEvent, match="invoice.sent"):
            shop_sessions.transaction({}, event_type="invoice.sent")
        with pytest.raises(UnroutedEvent, match="order.paid"):
            billing_sessions.transaction({})
    finally:
        shop.uninstall(shop_sessions.target)
        billing.uninstall(billing_sessions.target)
    assert stored(engine) == [
        ("billing_archive", {"from": "billing"}),
        ("billing_mail", {"from": "billing"}),
        ("shop_audit", {"from": "shop"}),
    ]


def test_two_outboxes_in_open_sessions_side_by_side_stay_separate(schema, engine):
    shop, billing = Outbox(), Outbox()
    shop.route("order.paid", _deliver, name="shop_audit")
    billing.route("invoice.sent", _deliver, name="billing_mail")
    billing.route("invoice.sent", _deliver, name="billing_archive", queue="archive")
    shop_sessions, billing_sessions = sessionmaker(engine), sessionmaker(engine)
    shop.install(shop_sessions)
    billing.install(billing_sessions)
    try:
        with pytest.raises(ConfigurationError, match="another Outbox"):
            billing.install(shop_sessions)
        with (
            received(signals.messages_committed, shop) as shop_commits,
            received(signals.messages_committed, billing) as billing_commits,
        ):
            # Both sessions open at once in one thread: neither may write the other's events.
            with shop_sessions() as a, a.begin(), billing_sessions() as b, b.begin():
                emit(a, "order.paid", {"from": "shop"})
                emit(b, "invoice.sent", {"from": "billing"})
                with pytest.raises(UnroutedEvent, match="invoice.sent"):
                    emit(a, "invoice.sent", {})
                with pytest.raises(UnroutedEvent, match="order.paid"):
                    emit(b, "order.paid", {})
        assert stored(engine) == [
            ("billing_archive", {"from": "billing"}),
            ("billing_mail", {"from": "billing"}),
            ("shop_audit", {"from": "shop"}),
        ]
        assert [c["queues"] for c in shop_commits] == [{"default"}]
        assert [c["queues"] for c in billing_commits] == [{"default", "archive"}]
    finally:
        shop.uninstall(shop_sessions)
        billing.uninstall(billing_sessions)


def test_outbox_on_a_sessionmaker_wins_over_one_on_its_session_class(schema, engine):
    app_session = type("AppSession", (Session,), {})
    general, specific = Outbox(), Outbox()
    general.route("order.paid", _deliver, name="general")
    specific.route("order.paid", _deliver, name="specific")
    maker = sessionmaker(engine, class_=app_session)
    general.install(app_session)
    specific.install(maker)
    try:
        with (
            received(signals.messages_committed, general) as general_commits,
            received(signals.messages_committed, specific) as specific_commits,
        ):
            with maker() as s, s.begin():
                emit(s, "order.paid", {"via": "maker"})
            with app_session(engine) as s, s.begin():
                emit(s, "order.paid", {"via": "class"})
        assert stored(engine) == [("general", {"via": "class"}), ("specific", {"via": "maker"})]
        assert (len(general_commits), len(specific_commits)) == (1, 1)  # one listener set per session
    finally:
        specific.uninstall(maker)
        general.uninstall(app_session)


# -- one session, transaction after transaction ------------------------------


@pytest.fixture
def served(schema: Engine) -> Iterator[tuple[Outbox, sessionmaker[Session]]]:
    ob = order_outbox()
    factory = sessionmaker(schema)
    ob.install(factory)
    yield ob, factory
    ob.uninstall(factory)


@pytest.fixture
def maker(served: tuple[Outbox, sessionmaker[Session]]) -> sessionmaker[Session]:
    return served[1]


def test_emit_with_no_other_orm_change_commits(maker, engine):
    with maker() as s, s.begin():
        emit(s, "order.paid", {"explicit": "begin"})
    with maker() as s:
        emit(s, "order.paid", {"auto": "begin"})
        s.commit()
    assert stored(engine) == fanned_out({"explicit": "begin"}, {"auto": "begin"})


def _rolled_back(s: Session) -> None:
    s.begin()
    emit(s, "order.paid", {"stale": True})
    s.rollback()


def _rolled_back_after_flush(s: Session) -> None:
    s.begin()
    s.add(Order(id=100, reference="flushed"))
    emit(s, "order.paid", {"stale": True})
    s.flush()  # the rows are written here, then discarded by the rollback
    s.rollback()


def _failed_flush(s: Session) -> None:
    s.begin()
    emit(s, "order.paid", {"stale": True})
    s.add(Order(id=1, reference="duplicate"))
    with pytest.raises(IntegrityError):
        s.flush()
    s.rollback()


def _failed_commit(s: Session) -> None:
    s.begin()
    s.add(Order(id=1, reference="duplicate"))
    emit(s, "order.paid", {"stale": True})
    with pytest.raises(IntegrityError):
        s.commit()
    s.rollback()


def _rolled_back_before_begin(s: Session) -> None:
    emit(s, "order.paid", {"stale": True})
    s.rollback()


def _closed_before_begin(s: Session) -> None:
    emit(s, "order.paid", {"stale": True})
    s.close()


def _reset_before_begin(s: Session) -> None:
    emit(s, "order.paid", {"stale": True})
    s.reset()


@pytest.mark.parametrize(
    "abandon",
    [
        _rolled_back,
        _rolled_back_after_flush,
        _failed_flush,
        _failed_commit,
        _rolled_back_before_begin,
        _closed_before_begin,
        _reset_before_begin,
    ],
    ids=lambda fn: fn.__name__.strip("_"),
)
def test_a_session_reused_after_abandoning_its_events_does_not_store_them(maker, engine, abandon):
    with engine.begin() as conn:
        conn.execute(insert(Order).values(id=1, reference="existing"))
    with maker() as s:
        abandon(s)
        with s.begin():
            s.add(Order(id=2, reference="next"))
        with s.begin():
            emit(s, "order.paid", {"fresh": True})
    assert stored(engine) == fanned_out({"fresh": True})
    assert order_ids(engine) == [1, 2]


def test_a_commit_after_a_committed_emit_writes_nothing_again(served, engine):
    ob, maker = served
    with maker() as s:
        with s.begin():
            emit(s, "order.paid", {"n": 1})
        with received(signals.messages_committed, ob) as committed:
            with s.begin():
                s.add(Order(id=5, reference="no event"))
        assert committed == []
    assert stored(engine) == fanned_out({"n": 1})
    assert order_ids(engine) == [5]


# -- signals ------------------------------------------------------------------


def test_event_emitted_fires_once_per_emit_with_documented_arguments(schema, engine):
    ob = order_outbox()
    other = order_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    try:
        with (
            received(signals.event_emitted, ob) as emitted,
            received(signals.event_emitted, other) as foreign,
        ):
            with factory() as s, s.begin():
                first = emit(s, "order.paid", {"n": 1}, key="order:1")
                second = emit(s, "order.paid", {"n": 2})
                assert stored(engine) == []  # signalled at emit, stored only at commit
                assert len(emitted) == 2
                session = s
        assert emitted == [
            {
                "session": session,
                "event_id": first,
                "event_type": "order.paid",
                "routes": ("audit", "ledger"),
            },
            {
                "session": session,
                "event_id": second,
                "event_type": "order.paid",
                "routes": ("audit", "ledger"),
            },
        ]
        assert foreign == []
    finally:
        ob.uninstall(factory)


def test_messages_committed_fires_after_commit_and_never_after_rollback(schema, engine):
    ob = order_outbox()
    factory = sessionmaker(engine)
    ob.install(factory)
    visible_when_signalled: list[list[tuple[str, Any]]] = []

    def on_commit(sender: Any, **kwargs: Any) -> None:
        # A separate connection sees the rows only once the commit has happened.
        visible_when_signalled.append(stored(engine))

    try:
        with signals.messages_committed.connected_to(on_commit, sender=ob):
            with received(signals.messages_committed, ob) as committed:
                with factory() as s:
                    s.begin()
                    emit(s, "order.paid", {"n": 1})
                    s.flush()
                    s.rollback()
                    assert committed == []
                    with s.begin():
                        emit(s, "order.paid", {"n": 2}, queue="urgent")
                    session = s
        assert committed == [{"session": session, "queues": {"urgent"}}]
        assert visible_when_signalled == [[("audit", {"n": 2}), ("ledger", {"n": 2})]]
    finally:
        ob.uninstall(factory)


# -- concurrency --------------------------------------------------------------


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_concurrent_emitters_of_one_key_store_it_once_per_route(maker, engine):
    threads = 8
    barrier = threading.Barrier(threads, timeout=30)
    errors: list[BaseException] = []
    ids: list[uuid.UUID] = []
    lock = threading.Lock()

    def emitter(n: int) -> None:
        try:
            with maker() as s, s.begin():
                s.add(Order(id=n, reference=f"thread {n}"))
                event_id = emit(s, "order.paid", {"thread": n}, key="payment:42")
                barrier.wait()  # every transaction commits (and inserts) at the same moment
            with lock:
                ids.append(event_id)
        except Exception as exc:  # any error in any thread fails the test
            with lock:
                errors.append(exc)
            barrier.abort()

    workers = [threading.Thread(target=emitter, args=(n,)) for n in range(1, threads + 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers)
    assert errors == []
    assert len(set(ids)) == 1 and len(ids) == threads
    rows = stored(engine)
    assert sorted(handler for handler, _ in rows) == ["audit", "ledger"]
    assert len({str(p) for _, p in rows}) == 1  # both rows come from the same (winning) emit
    assert order_ids(engine) == list(range(1, threads + 1))  # every business change committed


# -- async --------------------------------------------------------------------


def test_async_emit_and_mixin_emit_with_aggregate_id_known_only_after_flush(schema, engine, async_engine):
    ob = order_outbox()
    factory = async_sessionmaker(async_engine)
    ob.install(factory)

    async def scenario() -> tuple[uuid.UUID, uuid.UUID]:
        async with factory() as s:
            async with s.begin():
                order = Order(reference="async")
                s.add(order)
                assert order.id is None
                mixin_event = order.emit("order.paid", {"by": "mixin"})
                plain_event = emit(s, "order.paid", {"by": "function"})
            with pytest.raises(_Rollback):
                async with s.begin():  # the expired aggregate is flushed, then rolled back
                    order.reference = "changed"
                    order.emit("order.paid", {"by": "rolled back"})
                    await s.flush()
                    raise _Rollback
            return mixin_event, plain_event

    try:
        mixin_event, plain_event = asyncio.run(scenario())
    finally:
        ob.uninstall(factory)
    [order_id] = order_ids(engine)
    with engine.connect() as conn:
        rows = conn.execute(select(m).order_by(m.c.id)).all()
    assert sorted((r.handler, r.payload["by"]) for r in rows) == [
        ("audit", "function"),
        ("audit", "mixin"),
        ("ledger", "function"),
        ("ledger", "mixin"),
    ]
    by_event = {(r.event_id, r.aggregate_type, r.aggregate_id) for r in rows}
    assert by_event == {(mixin_event, "Order", str(order_id)), (plain_event, None, None)}


def test_async_session_reused_after_rollback_carries_no_stale_events(schema, engine, async_engine):
    ob = order_outbox()
    factory = async_sessionmaker(async_engine)
    ob.install(factory)

    async def scenario() -> None:
        async with factory() as s:
            await s.begin()
            s.add(Order(id=7, reference="rolled back"))
            emit(s, "order.paid", {"stale": True})
            await s.flush()
            await s.rollback()
            async with s.begin():
                s.add(Order(id=8, reference="kept"))
            emit(s, "order.paid", {"no": "explicit begin"})
            await s.commit()

    try:
        asyncio.run(scenario())
    finally:
        ob.uninstall(factory)
    assert stored(engine) == fanned_out({"no": "explicit begin"})
    assert order_ids(engine) == [8]
