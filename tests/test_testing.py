"""``outbox.testing`` used the way an application's own test suite uses it, on SQLite and PostgreSQL.

The application here is small but real: an installed ``Outbox`` with a sync and an async route,
fakes standing in for the outside world, events committed through ORM sessions.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from outbox import Backoff, Message, Outbox, PermanentError, RetryLater, emit
from outbox.testing import Recording, adrain, drain, messages, recording


class FakeMailer:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.answers: list[BaseException] = []  # raised in turn before anything is sent

    def send(self, to: str) -> None:
        if self.answers:
            raise self.answers.pop(0)
        self.sent.append(to)


class App:
    def __init__(self) -> None:
        self.mailer = FakeMailer()
        self.synced: list[tuple[str, asyncio.AbstractEventLoop]] = []
        self.ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.001))

        @self.ob.handler("user.signed_up", name="welcome_email", max_attempts=3)
        def welcome(msg: Message) -> None:
            if msg.payload["email"].endswith(".invalid"):
                raise PermanentError("undeliverable address")
            self.mailer.send(msg.payload["email"])

        @self.ob.handler("user.signed_up", name="crm_sync")
        async def crm_sync(msg: Message) -> None:
            self.synced.append((msg.payload["email"], asyncio.get_running_loop()))

        @self.ob.handler("order.paid", name="ledger", queue="billing")
        def ledger(msg: Message) -> None:
            pass


@pytest.fixture
def app() -> App:
    return App()


@pytest.fixture
def sessions(engine: Engine, app: App) -> Iterator[sessionmaker[Session]]:
    factory = sessionmaker(engine)
    app.ob.install(factory)
    yield factory
    app.ob.uninstall(factory)


def signup(sessions: sessionmaker[Session], *emails: str) -> None:
    with sessions.begin() as session:
        for email in emails:
            emit(session, "user.signed_up", {"email": email}, key=f"signup:{email}")


def pay(sessions: sessionmaker[Session], order_id: int) -> None:
    with sessions.begin() as session:
        emit(session, "order.paid", {"order_id": order_id})


# -- recording --------------------------------------------------------------------------------------


def test_recording_sees_what_the_block_committed_and_nothing_from_before(engine, sessions):
    signup(sessions, "before@example.com")
    with recording(engine) as rec:
        signup(sessions, "a@example.com")
        pay(sessions, 7)
    assert isinstance(rec, Recording)
    assert rec.event_types() == ["user.signed_up", "order.paid"], "one entry per event, in emit order"
    rows = rec.assert_emitted("user.signed_up", payload={"email": "a@example.com"}, count=1)
    assert sorted(r.handler for r in rows) == ["crm_sync", "welcome_email"], "one row per route"
    assert {r.status for r in rows} == {"pending"} and len({r.event_id for r in rows}) == 1
    assert [r.payload for r in rec.messages(handler="ledger")] == [{"order_id": 7}]
    assert rec.messages(event_type="user.signed_up", payload={"email": "before@example.com"}) == []


def test_recording_ignores_rolled_back_events(engine, sessions):
    with recording(engine) as rec:
        with pytest.raises(RuntimeError), sessions.begin() as session:
            emit(session, "user.signed_up", {"email": "a@example.com"})
            raise RuntimeError("payment provider down")
    rec.assert_nothing_emitted()
    assert rec.messages() == []


def test_recording_keeps_counting_after_the_block_until_you_look(engine, sessions):
    with recording(engine) as rec:
        signup(sessions, "a@example.com")
    signup(sessions, "b@example.com")
    rec.assert_emitted("user.signed_up", count=2)


def test_count_counts_events_and_the_same_key_is_one_event(engine, sessions):
    with recording(engine) as rec:
        signup(sessions, "a@example.com")
        signup(sessions, "a@example.com")  # the same idempotency key: stored once
        signup(sessions, "b@example.com")
    assert len(rec.assert_emitted("user.signed_up", count=2)) == 4
    rec.assert_emitted("user.signed_up", payload={"email": "b@example.com"}, count=1)


def test_failed_assertions_say_what_was_expected_and_what_was_committed(engine, sessions):
    with recording(engine) as rec:
        signup(sessions, "a@example.com")
        pay(sessions, 1)

    with pytest.raises(AssertionError) as wrong_count:
        rec.assert_emitted("user.signed_up", count=2)
    assert "expected 2 'user.signed_up' event(s), found 1" in str(wrong_count.value)
    assert "['user.signed_up', 'order.paid']" in str(wrong_count.value)

    with pytest.raises(AssertionError) as missing:
        rec.assert_emitted("user.deleted")
    assert "expected some 'user.deleted' event(s), found 0" in str(missing.value)

    with pytest.raises(AssertionError) as other_payload:  # the payload must match exactly, not partly
        rec.assert_emitted("order.paid", payload={})
    assert "with payload {}" in str(other_payload.value)

    with pytest.raises(AssertionError, match=r"expected no committed events, found \['user.signed_up'"):
        rec.assert_nothing_emitted()


# -- messages ---------------------------------------------------------------------------------------


def test_messages_filters_committed_rows_by_any_column_oldest_first(engine, sessions):
    signup(sessions, "a@example.com")
    pay(sessions, 1)
    pay(sessions, 2)
    ledger = messages(engine, handler="ledger")
    assert [r.payload["order_id"] for r in ledger] == [1, 2]
    assert [r.queue for r in ledger] == ["billing", "billing"]
    pending = messages(engine, queue="default", status="pending")
    assert sorted(r.handler for r in pending) == ["crm_sync", "welcome_email"]
    assert [r.payload["order_id"] for r in messages(engine, after_id=ledger[0].id)] == [2]
    assert messages(engine, status="dead") == []
    with pytest.raises(TypeError, match="no column 'colour'"):
        messages(engine, colour="red")


def test_every_kind_of_bind_reads_the_same_rows(engine, database_url, sessions):
    pay(sessions, 1)
    expected = [r.id for r in messages(engine)]
    with engine.connect() as conn:
        assert [r.id for r in messages(conn)] == expected
    with Session(engine) as session:
        assert [r.id for r in messages(session)] == expected
        with recording(session) as rec:
            pay(sessions, 2)
        assert [r.payload for r in rec.messages()] == [{"order_id": 2}]
    by_url = messages(database_url)
    assert [r.id for r in by_url[:-1]] == expected and by_url[-1].payload == {"order_id": 2}


def async_url(database_url: str) -> str:
    url = make_url(database_url)
    driver = "sqlite+aiosqlite" if url.get_backend_name() == "sqlite" else "postgresql+asyncpg"
    return url.set(drivername=driver).render_as_string(hide_password=False)


def test_async_engines_sessions_and_urls_read_the_same_rows(engine, database_url, sessions):
    """What an async application's tests hold: no second, synchronous URL needed."""
    pay(sessions, 1)
    expected = [r.id for r in messages(engine)]
    url = async_url(database_url)
    app_engine = create_async_engine(url, poolclass=NullPool)
    try:
        assert [r.id for r in messages(url)] == expected
        assert [r.id for r in messages(app_engine)] == expected
        assert [r.id for r in messages(AsyncSession(app_engine))] == expected
        with recording(AsyncSession(app_engine)) as rec:
            pay(sessions, 2)
        assert [r.payload for r in rec.messages()] == [{"order_id": 2}]
        with recording(url) as rec:
            pay(sessions, 3)
        rec.assert_emitted("order.paid", payload={"order_id": 3}, count=1)

        async def through_a_connection() -> list[int]:
            async with app_engine.connect() as conn:
                return [r.id for r in messages(conn)]

        assert len(asyncio.run(through_a_connection())) == 3
    finally:
        asyncio.run(app_engine.dispose())


def test_drain_and_adrain_take_async_binds(engine, database_url, sessions, app):
    url = async_url(database_url)
    signup(sessions, "a@example.com")
    assert drain(app.ob, url).delivered == 2
    signup(sessions, "b@example.com")
    app_engine = create_async_engine(url, poolclass=NullPool)
    try:
        assert drain(app.ob, AsyncSession(app_engine)).delivered == 2
        signup(sessions, "c@example.com")
        assert asyncio.run(adrain(app.ob, app_engine)).delivered == 2
    finally:
        asyncio.run(app_engine.dispose())
    assert sorted(app.mailer.sent) == ["a@example.com", "b@example.com", "c@example.com"]
    assert {r.status for r in messages(engine)} == {"delivered"}


def test_a_bind_of_another_kind_is_refused_by_name(sessions):
    from outbox import ConfigurationError

    with pytest.raises(ConfigurationError, match="expected an Engine, an AsyncEngine, .* got sessionmaker"):
        messages(sessions)


# -- drain ------------------------------------------------------------------------------------------


def test_drain_runs_the_real_handlers_here_and_now(engine, sessions, app):
    signup(sessions, "a@example.com", "b@example.com")
    result = drain(app.ob, engine)
    assert (result.delivered, result.retried, result.dead, result.attempts) == (4, 0, 0, 4)
    assert sorted(app.mailer.sent) == ["a@example.com", "b@example.com"]
    assert sorted(email for email, _ in app.synced) == ["a@example.com", "b@example.com"]
    assert {r.status for r in messages(engine)} == {"delivered"}
    assert drain(app.ob, engine).attempts == 0, "nothing left to deliver"


def test_drain_retries_what_falls_due_and_leaves_later_retries_pending(engine, sessions, app):
    app.mailer.answers = [RetryLater("greylisted", delay=0), ConnectionError("smtp down")]
    signup(sessions, "a@example.com")
    first = drain(app.ob, engine)
    [welcome] = messages(engine, handler="welcome_email")
    assert first.retried >= 1 and welcome.attempts >= 2, (
        "RetryLater(delay=0) is due at once, in the same drain"
    )
    totals = [first.delivered, first.retried, first.dead]
    for _ in range(50):  # the failure after it backs off a millisecond: drain until it is through
        if not messages(engine, status="pending"):
            break
        more = drain(app.ob, engine)
        totals = [totals[0] + more.delivered, totals[1] + more.retried, totals[2] + more.dead]
    assert totals == [2, 2, 0]
    [welcome] = messages(engine, handler="welcome_email")
    assert (welcome.status, welcome.attempts) == ("delivered", 3)

    app.mailer.answers = [RetryLater("mailbox full", delay=timedelta(hours=1))]
    signup(sessions, "b@example.com")
    later = drain(app.ob, engine)
    assert (later.delivered, later.retried) == (1, 1)
    [waiting] = messages(engine, handler="welcome_email", status="pending")
    assert waiting.payload == {"email": "b@example.com"} and waiting.attempts == 1


def test_drain_records_a_permanent_error_as_dead(engine, sessions, app):
    signup(sessions, "nobody@example.invalid")
    assert drain(app.ob, engine).dead == 1
    [dead] = messages(engine, status="dead")
    assert (dead.handler, dead.last_error) == ("welcome_email", "undeliverable address")


def test_drain_passes_relay_options_and_takes_any_bind(engine, database_url, sessions, app):
    signup(sessions, "a@example.com")
    pay(sessions, 1)
    only_billing = drain(app.ob, database_url, queues=["billing"])
    assert only_billing.delivered == 1
    assert {r.handler for r in messages(engine, status="pending")} == {"crm_sync", "welcome_email"}
    with Session(engine) as session:
        assert drain(app.ob, session, seed=1).delivered == 2
    assert {r.status for r in messages(engine)} == {"delivered"}


def test_adrain_runs_async_handlers_on_the_callers_loop(engine, sessions, app):
    signup(sessions, "a@example.com")

    async def scenario() -> tuple[Any, asyncio.AbstractEventLoop]:
        return await adrain(app.ob, engine), asyncio.get_running_loop()

    result, loop = asyncio.run(scenario())
    assert result.delivered == 2
    assert app.synced == [("a@example.com", loop)]
    assert app.mailer.sent == ["a@example.com"]


def test_importing_outbox_testing_does_not_load_the_relay():
    check = (
        "import sys, outbox.testing; print(sorted(m for m in sys.modules if m.startswith('outbox.relay')))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
