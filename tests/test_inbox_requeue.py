"""Requeued inbox dead letters on SQLite and PostgreSQL: the operator's requeue, the consumer's second try.

An operator requeues a dead letter (``ops.requeue_inbox_dead_letter(s)``), and
its inbox's ``process_requeued`` runs the handlers once more, in one
transaction that marks it ``handled``; handlers that fail make it ``dead``
again, once, with the new error. The marker is never changed. Effects are
rows of ``effects`` (test_inbox's table, no unique constraint: a second
application would show) and follow-up events in ``outbox_message``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, func, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from test_inbox import effects

import outbox
from outbox import ConfigurationError, Inbox, InboxMessage, NoInboxHandler, Outbox, PermanentError, emit, ops

i, dead, m = outbox.outbox_inbox, outbox.outbox_inbox_dead, outbox.outbox_message
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg_async"}
SENT = datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
WAIT = 30.0  # a failure guard only


class Billing:
    """An inbox whose ``order.paid`` handler fails until ``fixed``, then books and emits; what it saw."""

    def __init__(self, name: str = "billing") -> None:
        self.inbox = Inbox(name, max_failures=1, keep=timedelta(days=30))
        self.fixed = False
        self.seen: list[InboxMessage] = []

        @self.inbox.handler("order.paid", name="bill")
        def bill(session: Session, message: InboxMessage) -> None:
            self.seen.append(message)
            session.execute(insert(effects).values(message_id=message.id, handler="bill"))
            emit(session, "invoice.requested", {"order": message.payload["order"]})
            if not self.fixed:
                raise PermanentError(f"order {message.payload['order']} has no customer")


@pytest.fixture
def maker(engine: Engine) -> Iterator[sessionmaker[Session]]:
    effects.create(engine)
    ob = Outbox()
    ob.route("invoice.requested", lambda msg: None, name="invoicing")
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def letters(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {row.message_id: row for row in conn.execute(select(dead))}


def counts(engine: Engine) -> tuple[int, int]:
    """(effects applied, follow-up events emitted)."""
    with engine.connect() as conn:
        applied = conn.execute(select(func.count()).select_from(effects)).scalar_one()
        emitted = conn.execute(select(func.count()).select_from(m)).scalar_one()
    return applied, emitted


def markers(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(i.c.message_id, i.c.outcome)).all())


def dead_letter_of(
    billing: Billing, maker: sessionmaker[Session], message_id: str = "m1", order: int = 7
) -> int:
    message = InboxMessage(
        message_id,
        "order.paid",
        {"order": order, "card_token": "tok_42"},
        {"trace": "t1"},
        "rabbitmq:orders",
        SENT,
    )
    result = billing.inbox.process(maker, message)
    assert result.outcome == "dead" and result.dead_letter_id is not None
    return result.dead_letter_id


def test_a_requeued_dead_letter_is_handled_once_and_its_marker_stays_dead(engine, maker):
    billing = Billing()
    dead_id = dead_letter_of(billing, maker)
    assert counts(engine) == (0, 0)
    assert billing.inbox.process_requeued(maker) == []  # nothing requeued: nothing runs

    letter = ops.requeue_inbox_dead_letter(engine, dead_id, actor="ana", reason="customer 7 imported")
    assert (letter.status, letter.actor, letter.reason) == ("requeued", "ana", "customer 7 imported")
    assert letter.payload["card_token"] == "***"  # masked, as `outbox inbox dead` masks it
    billing.fixed = True
    [result] = billing.inbox.process_requeued(maker)
    assert (result.message_id, result.outcome, result.handlers, result.dead_letter_id) == (
        "m1",
        "handled",
        ("bill",),
        dead_id,
    )
    again = billing.seen[-1]
    # The message as the source handed it in, one delivery on from the dead letter's attempts.
    assert (again.id, again.event_type, again.payload, dict(again.headers), again.source, again.sent_at) == (
        "m1",
        "order.paid",
        {"order": 7, "card_token": "tok_42"},
        {"trace": "t1"},
        "rabbitmq:orders",
        SENT,
    )
    assert again.attempt == 2
    assert counts(engine) == (1, 1)  # the effect and the follow-up event, committed with the mark
    row = letters(engine)["m1"]
    assert (row.status, row.attempts, row.actor, row.reason) == ("handled", 1, "ana", "customer 7 imported")
    assert row.requeued_at is not None and row.handled_at is not None and row.handled_at >= row.requeued_at
    assert markers(engine) == {"m1": "dead"}  # markers are never changed

    assert billing.inbox.process_requeued(maker) == []  # handled is final
    assert billing.inbox.process(maker, InboxMessage("m1", "order.paid", {"order": 7})).outcome == "duplicate"
    assert counts(engine) == (1, 1)
    with pytest.raises(ops.OpsError, match="not 1 \\(handled\\)|is handled, not dead"):
        ops.requeue_inbox_dead_letter(engine, dead_id, actor="ana", reason="once more")


def test_handlers_that_fail_again_make_it_dead_again_once_with_the_new_error(engine, maker):
    billing = Billing()
    dead_id = dead_letter_of(billing, maker)
    before = letters(engine)["m1"]
    ops.requeue_inbox_dead_letter(engine, dead_id, actor="ana", reason="try again")
    ledger_open = False

    @billing.inbox.handler("order.#", name="ledger")
    def ledger(session: Session, message: InboxMessage) -> None:
        if not ledger_open:
            raise ValueError("ledger closed for the night")

    billing.fixed = True  # bill succeeds now; the ledger after it fails, and takes bill's effects with it
    [result] = billing.inbox.process_requeued(maker)
    assert (result.outcome, result.handlers, type(result.error), result.dead_letter_id) == (
        "dead",
        ("bill", "ledger"),
        ValueError,
        dead_id,
    )
    assert counts(engine) == (0, 0)
    row = letters(engine)["m1"]
    assert (row.status, row.attempts, row.error_type, row.error) == (
        "dead",
        2,
        "ValueError",
        "ledger closed for the night",
    )
    assert (row.actor, row.reason, row.handled_at) == (
        "ana",
        "try again",
        None,
    )  # the requeue stays on record
    assert row.dead_at >= row.requeued_at >= before.dead_at
    assert billing.inbox.process_requeued(maker) == []  # tried once: the operator decides again
    assert len(billing.seen) == 2
    assert markers(engine) == {"m1": "dead"}

    ledger_open = True
    ops.requeue_inbox_dead_letter(engine, dead_id, actor="bo", reason="ledger is open")
    assert [r.outcome for r in billing.inbox.process_requeued(maker)] == ["handled"]
    assert billing.seen[-1].attempt == 3
    assert counts(engine) == (1, 1)
    row = letters(engine)["m1"]
    assert (row.status, row.attempts, row.actor, row.reason) == ("handled", 2, "bo", "ledger is open")


def test_still_no_handler_is_dead_again_without_an_attempt(engine, maker):
    inbox = Inbox("shipping")
    result = inbox.process(maker, InboxMessage("r1", "order.refunded", {"order": 7}))
    assert isinstance(result.error, NoInboxHandler)
    ops.requeue_inbox_dead_letters(engine, consumer="shipping", actor="ana", reason="refunds handled now?")
    [again] = inbox.process_requeued(maker)
    assert (again.outcome, type(again.error), again.handlers) == ("dead", NoInboxHandler, ())
    row = letters(engine)["r1"]
    assert (row.status, row.attempts, row.error_type) == ("dead", 0, "outbox.NoInboxHandler")

    ops.requeue_inbox_dead_letters(engine, [row.id], actor="ana", reason="now it is")
    inbox.handler("order.refunded", name="refund")(
        lambda session, message: session.execute(
            insert(effects).values(message_id=message.id, handler="refund")
        )
    )
    assert [r.outcome for r in inbox.process_requeued(maker)] == ["handled"]
    assert counts(engine) == (1, 0)


def test_each_inbox_takes_only_its_own_oldest_first_and_at_most_limit(engine, maker):
    billing, other = Billing(), Billing("invoicing")
    ids = [dead_letter_of(billing, maker, f"m{n}", n) for n in range(1, 5)]
    theirs = dead_letter_of(other, maker, "x1")
    done = ops.requeue_inbox_dead_letters(engine, reversed(ids), actor="ana", reason="all of them")
    assert done == sorted(ids)
    billing.fixed = True
    first = billing.inbox.process_requeued(maker, limit=3)
    assert [(r.message_id, r.dead_letter_id) for r in first] == [(f"m{n}", ids[n - 1]) for n in range(1, 4)]
    assert [r.message_id for r in billing.inbox.process_requeued(maker, limit=3)] == ["m4"]
    assert letters(engine)["m1"].status == "handled"
    with engine.connect() as conn:
        assert conn.execute(select(dead.c.status).where(dead.c.id == theirs)).scalar_one() == "dead"
    for bad in (0, 1001, True, "10"):
        with pytest.raises(ValueError, match="limit must be a whole number from 1 to 1000"):
            billing.inbox.process_requeued(maker, limit=bad)


def test_requeue_refuses_unknown_ids_and_other_statuses_all_or_none(engine, maker):
    billing = Billing()
    first, second = dead_letter_of(billing, maker, "m1"), dead_letter_of(billing, maker, "m2")
    with pytest.raises(ops.NotFound, match=f"no inbox dead letter with id {second + 100}"):
        ops.requeue_inbox_dead_letters(engine, [first, second + 100], actor="ana", reason="r")
    ops.requeue_inbox_dead_letter(engine, second, actor="ana", reason="r")
    with pytest.raises(ops.OpsError, match=f"not {second} \\(requeued\\)"):
        ops.requeue_inbox_dead_letters(engine, [first, second], actor="ana", reason="r")
    assert letters(engine)["m1"].status == "dead"  # all or none
    for kwargs, problem in (
        ({"reason": " ", "actor": "ana"}, "a reason is required"),
        ({"reason": "r", "actor": ""}, "an actor is required"),
        ({"reason": "r", "actor": "a" * 256}, "longer than 255"),
    ):
        with pytest.raises(ops.InvalidRequest, match=problem):
            ops.requeue_inbox_dead_letter(engine, first, **kwargs)
    for ids, consumer in (([], None), ([first], "billing")):
        with pytest.raises(ops.InvalidRequest, match="give dead letter ids or a consumer"):
            ops.requeue_inbox_dead_letters(engine, ids, consumer=consumer, actor="ana", reason="r")
    for bad in (0, -1, 2**63, "1", True):
        with pytest.raises(ops.InvalidRequest, match="a dead letter id is a whole number"):
            ops.requeue_inbox_dead_letter(engine, bad, actor="ana", reason="r")
    assert letters(engine)["m1"].status == "dead"


def test_requeue_by_consumer_takes_every_dead_one_in_batches_and_nothing_else(engine, maker):
    billing, other = Billing(), Billing("invoicing")
    ids = [dead_letter_of(billing, maker, f"m{n}", n) for n in range(1, 6)]
    dead_letter_of(other, maker, "x1")
    ops.requeue_inbox_dead_letter(engine, ids[0], actor="ana", reason="the first alone")
    done = ops.requeue_inbox_dead_letters(engine, consumer="billing", actor="bo", reason="all", batch_size=2)
    assert done == ids[1:]
    rows = letters(engine)
    assert {rows[f"m{n}"].status for n in range(1, 6)} == {"requeued"}
    assert rows["m1"].actor == "ana" and rows["m2"].actor == "bo"
    assert rows["x1"].status == "dead"
    assert ops.requeue_inbox_dead_letters(engine, consumer="billing", actor="bo", reason="again") == []
    assert ops.count_inbox_dead_letters(engine, consumer="billing", status="requeued") == 5
    assert ops.count_inbox_dead_letters(engine) == 1


def test_aprocess_requeued_runs_async_and_plain_handlers(database_url, engine, maker):
    billing = Billing()
    dead_id = dead_letter_of(billing, maker)
    ops.requeue_inbox_dead_letter(engine, dead_id, actor="ana", reason="async consumer")
    inbox = Inbox("billing")
    seen: list[int] = []

    @inbox.handler("order.paid", name="bill")
    async def bill(session: AsyncSession, message: InboxMessage) -> None:
        seen.append(message.attempt)
        await session.execute(insert(effects).values(message_id=message.id, handler="bill"))

    @inbox.handler("order.#", name="ledger")
    def ledger(session: Session, message: InboxMessage) -> None:
        session.execute(insert(effects).values(message_id=message.id, handler="ledger"))

    url = make_url(database_url)
    async_url = url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()])

    async def scenario() -> list[Any]:
        async_engine = create_async_engine(async_url)
        try:
            sessions = async_sessionmaker(async_engine)
            first = await inbox.aprocess_requeued(sessions)
            return [first, await inbox.aprocess_requeued(async_engine)]
        finally:
            await async_engine.dispose()

    first, second = asyncio.run(scenario())
    assert [(r.outcome, r.handlers) for r in first] == [("handled", ("bill", "ledger"))]
    assert second == [] and seen == [2]
    assert counts(engine) == (2, 0)
    assert letters(engine)["m1"].status == "handled"

    ops.requeue_inbox_dead_letter(engine, dead_letter_of(billing, maker, "m2"), actor="ana", reason="r")
    with pytest.raises(ConfigurationError, match="await inbox.aprocess_requeued"):
        inbox.process_requeued(maker)
    assert letters(engine)["m2"].status == "requeued"  # refused before anything ran


def test_two_consumer_processes_never_both_take_it_nor_wait_for_each_other(pg_engine):
    """PostgreSQL: the first holds the dead letter while its handler runs; the second skips it at once."""
    effects.create(pg_engine)
    inbox = Inbox("billing")
    running, release = threading.Event(), threading.Event()

    @inbox.handler("order.paid", name="bill")
    def bill(session: Session, message: InboxMessage) -> None:
        session.execute(insert(effects).values(message_id=message.id, handler="bill"))
        running.set()
        assert release.wait(WAIT)

    with Session(pg_engine) as s, s.begin():
        dead_id = inbox.dead_letter(
            s, InboxMessage("m1", "order.paid", {"order": 7}), ValueError("no customer")
        )
    assert dead_id is not None
    ops.requeue_inbox_dead_letter(pg_engine, dead_id, actor="ana", reason="r")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(inbox.process_requeued, pg_engine)
        assert running.wait(WAIT)
        # The second reads it as requeued (the first has not committed) and never waits for its lock:
        # were it to wait, this result would not come before the release below.
        [second] = pool.submit(inbox.process_requeued, pg_engine).result(timeout=WAIT)
        assert (second.outcome, second.dead_letter_id) == ("duplicate", dead_id)
        release.set()
        [taken] = first.result(timeout=WAIT)
    assert taken.outcome == "handled"
    assert counts(pg_engine) == (1, 0)
    assert letters(pg_engine)["m1"].status == "handled"


def test_a_requeue_wakes_listening_consumers_with_their_name(pg_url, pg_engine):
    import psycopg

    with Session(pg_engine) as s, s.begin():
        dead_id = Inbox("billing").dead_letter(s, InboxMessage("m1", "order.paid"), ValueError("x"))
    dsn = make_url(pg_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox_inbox")
        ops.requeue_inbox_dead_letter(pg_engine, dead_id, actor="ana", reason="r")
        heard = next(listener.notifies(timeout=WAIT, stop_after=1))
    assert (heard.channel, heard.payload) == ("outbox_inbox", "billing")


def test_an_older_schema_says_to_migrate(pg_url):
    """A database still at outbox_0021 has no requeue functions: one line that names the fix."""
    outbox.downgrade(pg_url, "outbox_0021")
    engine = create_engine(pg_url)
    try:
        with pytest.raises(ConfigurationError, match="run `outbox migrate` first"):
            Inbox("billing").process_requeued(engine)
    finally:
        engine.dispose()


def test_the_downgrade_keeps_requeued_dead_letters_and_who_requeued_them(empty_url):
    outbox.upgrade(empty_url)
    engine = create_engine(empty_url)
    try:
        inbox = Inbox("billing")
        inbox.handler("order.paid", name="bill")(lambda session, message: None)
        with Session(engine) as s, s.begin():
            dead_id = inbox.dead_letter(s, InboxMessage("m1", "order.paid"), ValueError("no customer"))
        ops.requeue_inbox_dead_letter(engine, dead_id, actor="ana", reason="r")
        with pytest.raises(RuntimeError, match="1 inbox dead letter\\(s\\) are requeued"):
            outbox.downgrade(empty_url, "outbox_0021")
        assert [r.outcome for r in inbox.process_requeued(engine)] == ["handled"]
        if engine.dialect.name == "postgresql":  # the database recorded the requeue's login
            with pytest.raises(RuntimeError, match="db_user records the login of 1 requeue"):
                outbox.downgrade(empty_url, "outbox_0021")
            return
        outbox.downgrade(empty_url, "outbox_0021")  # SQLite: no login was recorded
        with engine.connect() as conn:
            row = conn.execute(select(dead.c.status, dead.c.actor)).one()
        assert tuple(row) == ("handled", "ana")
        assert outbox.upgrade(empty_url)[0] == "outbox_0022"  # then any later revision
    finally:
        engine.dispose()
