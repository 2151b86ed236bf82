"""``NotInstalled`` says which session was refused, where it came from, and what is installed.

And a session's fate does not hang on import order: a session made before
``ob.install()`` is served once its class is, whichever came first, for sync
makers and for async makers given a sync session class of their own.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

import outbox
from outbox import Message, NotInstalled, Outbox, emit


def _deliver(msg: Message) -> None:
    pass


@pytest.fixture
def ob() -> Outbox:
    ob = Outbox()
    ob.route("order.paid", _deliver, name="ledger")
    return ob


@pytest.fixture
def async_engine(database_url: str) -> Iterator[AsyncEngine]:
    url = make_url(database_url)
    driver = "sqlite+aiosqlite" if url.get_backend_name() == "sqlite" else "postgresql+psycopg_async"
    eng = create_async_engine(url.set(drivername=driver), poolclass=NullPool)
    yield eng
    asyncio.run(eng.dispose())


def stored(engine: Engine) -> list[dict[str, int]]:
    m = outbox.outbox_message
    with engine.connect() as conn:
        return list(conn.scalars(select(m.c.payload).order_by(m.c.id)))


def shown(url: object) -> str:
    return make_url(str(url)).render_as_string(hide_password=True) if "://" in str(url) else str(url)


def test_a_session_built_directly_is_named_beside_the_maker_that_is_installed(engine, ob):
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with Session(engine) as direct, pytest.raises(NotInstalled) as refused:
            emit(direct, "order.paid", {"n": 1})
    finally:
        ob.uninstall(maker)
    said = str(refused.value)
    where = engine.url.render_as_string(hide_password=True)
    assert said.startswith(
        f"no Outbox is installed for this Session, bound to {where}: it is of the plain Session class, "
        "so it was built directly; installed on: "
    )
    assert f"sessionmaker bound to {where}" in said
    assert said.endswith(
        "call ob.install(...) on the sessionmaker or class your sessions come from, or make this session "
        "with an installed maker (in a test: maker(bind=connection))"
    )


def test_a_session_of_another_maker_and_of_a_subclass(engine, ob):
    class AppSession(Session):
        pass

    installed = sessionmaker(engine)
    ob.install(installed)
    try:
        with sessionmaker(engine)() as other, pytest.raises(NotInstalled) as refused:
            emit(other, "order.paid", {"n": 1})
        assert "made by a sessionmaker on which no Outbox is installed" in str(refused.value)
        with AppSession(engine) as mine, pytest.raises(NotInstalled) as refused:
            emit(mine, "order.paid", {"n": 1})
        assert f"for this {__name__}.{AppSession.__qualname__} session, bound to" in str(refused.value)
    finally:
        ob.uninstall(installed)


def test_an_async_session_is_named_as_such_with_both_ways_it_could_have_missed(engine, async_engine, ob):
    maker = async_sessionmaker(async_engine)
    early = maker()  # made before the install: it runs on the plain Session class
    ob.install(maker)
    try:
        for session in (early, AsyncSession(async_engine)):
            with pytest.raises(NotInstalled) as refused:
                emit(session, "order.paid", {"n": 1})
            said = str(refused.value)
            assert said.startswith("no Outbox is installed for this AsyncSession, bound to ")
            assert "it runs on the plain Session class, so it was built directly (AsyncSession(...))" in said
            assert "or made by an async_sessionmaker before ob.install() gave that maker" in said
            assert "create the maker with sync_session_class=YourSession" in said
            assert f"installed on: async_sessionmaker bound to {shown(async_engine.url)}" in said
    finally:
        ob.uninstall(maker)
        asyncio.run(early.close())


def test_installed_targets_are_listed_by_kind_and_database_without_passwords(ob):
    from sqlalchemy.orm import scoped_session

    engine = create_engine("postgresql+psycopg://app:s3cret-pw@db.example/shop")  # never connects
    maker = sessionmaker(engine)
    scoped = scoped_session(sessionmaker(engine))
    other = Outbox()
    other.route("order.paid", _deliver, name="ledger")
    ob.install(maker)
    other.install(scoped)
    try:
        with Session(engine) as direct, pytest.raises(NotInstalled) as refused:
            emit(direct, "order.paid", {"n": 1})
    finally:
        ob.uninstall(maker)
        other.uninstall(scoped)
    said = str(refused.value)
    assert "s3cret-pw" not in said
    assert "sessionmaker bound to postgresql+psycopg://app:***@db.example/shop" in said
    assert "scoped_session of sessionmaker bound to postgresql+psycopg://app:***@db.example/shop" in said


def test_with_nothing_installed_it_says_so():
    check = (
        "import outbox\nfrom sqlalchemy.orm import Session\n"
        "try:\n    outbox.emit(Session(), 'x', {})\nexcept outbox.NotInstalled as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (
        "no Outbox is installed for this Session: it is of the plain Session class, so it was built "
        "directly; installed on: nothing (no ob.install() has run in this process); call ob.install(...) "
        "on the sessionmaker or class your sessions come from, or make this session with an installed "
        "maker (in a test: maker(bind=connection))"
    )


def test_uninstalled_targets_leave_the_list(engine, ob):
    class Uninstalled(Session):
        pass

    ob.install(Uninstalled)
    ob.uninstall(Uninstalled)
    with Uninstalled(engine) as session, pytest.raises(NotInstalled) as refused:
        emit(session, "order.paid", {"n": 1})
    assert "Uninstalled class" not in str(refused.value)


# -- import order ---------------------------------------------------------------------------------


def test_a_session_made_before_the_install_of_its_sessionmaker_is_served(engine, ob):
    maker = sessionmaker(engine)
    early = maker()  # e.g. a fixture that ran before the application module installed
    ob.install(maker)
    try:
        with early, early.begin():
            emit(early, "order.paid", {"n": 1})
    finally:
        ob.uninstall(maker)
    assert stored(engine) == [{"n": 1}]


def test_an_async_maker_given_a_sync_session_class_serves_sessions_made_before_the_install(
    engine, async_engine, ob
):
    class AppSession(Session):
        pass

    maker = async_sessionmaker(async_engine, sync_session_class=AppSession)

    async def scenario() -> None:
        early = maker()
        ob.install(maker)
        try:
            async with early, early.begin():
                emit(early, "order.paid", {"n": 1})
        finally:
            ob.uninstall(maker)

    asyncio.run(scenario())
    assert stored(engine) == [{"n": 1}]


def test_the_async_session_class_describes_the_class_its_sessions_run_on(engine, ob):
    class AppAsyncSession(AsyncSession):
        sync_session_class = type("AppSyncSession", (Session,), {})

    ob.install(AppAsyncSession)
    try:
        with Session(engine) as direct, pytest.raises(NotInstalled) as refused:
            emit(direct, "order.paid", {"n": 1})
    finally:
        ob.uninstall(AppAsyncSession)
    assert f"the {__name__}.{AppAsyncSession.__qualname__} class (its sessions run on " in str(refused.value)
