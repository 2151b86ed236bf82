"""``outbox.testing.reset()`` on a test database full of history, on SQLite and PostgreSQL.

The tables it empties refuse DELETE and TRUNCATE to everyone else, before and
after: the reset lifts that for itself, in one transaction, only when told the
database is disposable, and only as the tables' owner.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from test_roles import guide_roles

import outbox
from outbox import ConfigurationError, Message, Outbox, emit, ops
from outbox.testing import drain, messages, reset

TABLES = (
    outbox.outbox_message,
    outbox.outbox_attempt,
    outbox.outbox_pause,
    outbox.outbox_pause_log,
    outbox.outbox_retention_run,
    outbox.outbox_breaker,
    outbox.outbox_breaker_log,
)


def counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one() for t in TABLES}


def _deliver(msg: Message) -> None:
    pass


@pytest.fixture
def ob() -> Outbox:
    ob = Outbox()
    ob.route("user.signed_up", _deliver, name="welcome")
    return ob


def signup(maker: sessionmaker[Session], n: int) -> None:
    with maker.begin() as session:
        emit(session, "user.signed_up", {"n": n})


def a_busy_day(engine: Engine, ob: Outbox, maker: sessionmaker[Session]) -> None:
    """Rows in every table the reset empties: deliveries, history, pauses, a purge, a breaker."""
    for n in range(3):
        signup(maker, n)
    assert drain(ob, engine).delivered == 3
    ops.pause(engine, queue="default", reason="maintenance", actor="tests")
    ops.resume(engine, queue="default", reason="done", actor="tests")
    ops.pause(engine, handler="welcome", reason="partner down", actor="tests")
    ops.purge(engine, delivered_older_than=timedelta(0))
    signup(maker, 4)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            insert(outbox.outbox_breaker).values(
                destination="https://partner.example", handler="welcome", failures=5, opened_at=now,
                reopen_at=now + timedelta(minutes=1), opened_by="relay-1", updated_at=now,
            )
        )  # fmt: skip
        conn.execute(
            insert(outbox.outbox_breaker_log).values(
                event="opened", destination="https://partner.example", handler="welcome", at=now,
                relay_id="relay-1", failures=5,
            )
        )  # fmt: skip


def refused(engine: Engine, statement: str) -> None:
    # SQLite's history trigger asks a function only a purge's connection has.
    with pytest.raises(DBAPIError, match="append-only|no such function: outbox_purge_in_progress"):
        with engine.begin() as conn:
            conn.execute(text(statement))


def test_reset_empties_every_outbox_table_and_the_guards_stand_again(engine, ob, maker):
    a_busy_day(engine, ob, maker)
    before = counts(engine)
    assert all(before.values()), before

    emptied = reset(engine, disposable=True)

    assert set(emptied) == outbox._migrations.OUTBOX_TABLES
    assert counts(engine) == dict.fromkeys(before, 0)
    assert outbox.upgrade(engine) == [], "the schema stays migrated"
    signup(maker, 5)
    assert [(r.id, r.payload) for r in messages(engine)] == [(1, {"n": 5})], "ids start again"
    assert ops.paused(engine) == []
    assert drain(ob, engine).delivered == 1, "the handler's pause went with the rest"

    a_busy_day(engine, ob, maker)  # history again, which nobody else may delete
    refused(engine, "DELETE FROM outbox_attempt")
    refused(engine, "DELETE FROM outbox_pause_log")
    refused(engine, "DELETE FROM outbox_breaker_log")
    if engine.dialect.name == "postgresql":
        refused(engine, "TRUNCATE outbox_attempt")
        refused(engine, "TRUNCATE outbox_pause_log")
        refused(engine, "TRUNCATE outbox_breaker_log")


def test_reset_refuses_unless_told_the_database_is_disposable(engine, ob, maker):
    signup(maker, 1)
    for said in ({}, {"disposable": False}, {"disposable": "yes"}):
        with pytest.raises(ConfigurationError, match=r"throwaway test database only.*disposable=True"):
            reset(engine, **said)
    assert len(messages(engine)) == 1


def test_reset_takes_a_url_or_an_async_engine_and_disposes_what_it_made(engine, database_url, ob, maker):
    from sqlalchemy.ext.asyncio import create_async_engine

    signup(maker, 1)
    reset(database_url, disposable=True)
    assert messages(engine) == []
    signup(maker, 2)
    driver = "sqlite+aiosqlite" if engine.dialect.name == "sqlite" else "postgresql+asyncpg"
    app_engine = create_async_engine(engine.url.set(drivername=driver))
    reset(app_engine, disposable=True)
    assert messages(engine) == []


def test_a_database_without_outbox_tables_is_named(empty_url):
    with pytest.raises(ConfigurationError, match=r"no outbox tables .* outbox.upgrade\(engine\)"):
        reset(empty_url, disposable=True)


def test_only_the_owner_of_the_tables_may_reset(pg_url):
    engine = outbox.testing._binds.sync_engine(pg_url)
    ob = Outbox()
    ob.route("user.signed_up", _deliver, name="welcome")
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        signup(maker, 1)
        for roles in guide_roles(pg_url):
            operator = roles.engine("outbox_operator")
            name = roles.names["outbox_operator"]
            with pytest.raises(ConfigurationError, match=rf"must run as the owner .*; connected as {name}"):
                reset(operator, disposable=True)
        assert len(messages(engine)) == 1
    finally:
        ob.uninstall(maker)
        engine.dispose()


def test_history_survives_a_failed_reset(pg_url: str) -> None:
    """A reset that fails part-way (a row of the app's own references a message) leaves everything."""
    engine = outbox.testing._binds.sync_engine(pg_url)
    ob = Outbox()
    ob.route("user.signed_up", _deliver, name="welcome")
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        signup(maker, 1)
        assert drain(ob, engine).delivered == 1
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE app_receipts (message_id bigint REFERENCES outbox_message (id))"))
            conn.execute(text("INSERT INTO app_receipts SELECT id FROM outbox_message"))
        before = counts(engine)
        with pytest.raises(DBAPIError, match="app_receipts"):
            reset(engine, disposable=True)
        assert counts(engine) == before
        refused(engine, "TRUNCATE outbox_attempt")
        with engine.connect() as conn:
            disabled: Any = conn.execute(
                text("SELECT count(*) FROM pg_trigger WHERE tgenabled = 'D' AND NOT tgisinternal")
            ).scalar_one()
        assert disabled == 0
    finally:
        ob.uninstall(maker)
        engine.dispose()
