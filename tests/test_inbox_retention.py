"""Markers are kept for their inbox's window and leave only through the recorded purge, on both databases.

The window and the refusal of late messages work together: a marker is purged
only after ``keep`` has passed since it was received, and by then the message
it stands for is older than ``keep`` too, so a redelivery of it is refused
rather than applied a second time.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from aging import age_markers
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from test_ops_cli import ok, ok_json, run

import outbox
from outbox import Inbox, InboxMessage, MessageTooOld, ops

i, dead, runs = outbox.outbox_inbox, outbox.outbox_inbox_dead, outbox.outbox_retention_run


def kept(engine: Engine) -> set[tuple[str, str]]:
    with engine.connect() as conn:
        return {(r.consumer, r.message_id) for r in conn.execute(select(i.c.consumer, i.c.message_id))}


def test_a_purge_deletes_only_markers_past_their_window_and_records_how_many(engine):
    short, long = Inbox("short", keep=timedelta(days=1)), Inbox("long", keep=timedelta(days=30))
    with Session(engine) as s, s.begin():
        for n in range(3):
            short.receive(s, f"s{n}")
        long.receive(s, "l0")
    age_markers(engine, timedelta(days=2))  # past short's window, well inside long's
    with Session(engine) as s, s.begin():
        short.receive(s, "fresh")

    result = ops.purge(engine, delivered_older_than=timedelta(days=30), batch_size=2)
    assert (result.messages, result.attempts, result.markers, result.batches) == (0, 0, 3, 2)
    assert kept(engine) == {("long", "l0"), ("short", "fresh")}
    with engine.connect() as conn:
        record = conn.execute(select(runs)).one()
    assert (record.markers_deleted, record.messages_deleted) == (3, 0)
    assert record.finished_at is not None
    # The purge's own connections refuse a plain DELETE again afterwards, saying why.
    with pytest.raises(DBAPIError, match="kept until kept_until|no such function"), engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_inbox"))


def test_outbox_purge_reports_the_markers_it_deleted(engine, database_url):
    inbox = Inbox("billing", keep=timedelta(hours=1))
    with Session(engine) as s, s.begin():
        inbox.receive(s, "m1")
    age_markers(engine, timedelta(hours=2))
    purged = ok_json(run("purge", "--delivered-older-than", "30d", "--json", database_url=database_url))
    assert purged == {"messages": 0, "attempts": 0, "markers": 1, "batches": 1}
    assert kept(engine) == set()


def test_markers_and_dead_letters_refuse_changes_outside_the_purge(engine):
    inbox = Inbox("billing")
    with Session(engine) as s, s.begin():
        inbox.receive(s, "m1")
        inbox.dead_letter(s, InboxMessage("m2", "order.paid"), ValueError("no customer"))
    age_markers(engine, timedelta(days=30))  # expired: still, only a purge may delete it
    refusals = [
        ("UPDATE outbox_inbox SET outcome = 'handled'", "never changed|UPDATE is not allowed"),
        ("DELETE FROM outbox_inbox", "kept until kept_until|outbox_purge_in_progress"),
        ("DELETE FROM outbox_inbox_dead", "is a record"),
        # Even the tables' owner (these tests) may only move a status the way a requeue does
        # (outbox_0022), and never change the message itself.
        ("UPDATE outbox_inbox_dead SET status = 'handled'", "may only requeue a dead letter"),
        ("UPDATE outbox_inbox_dead SET event_type = 'order.refunded'", "never change its message"),
        ("UPDATE outbox_inbox_dead SET status = 'requeued'", None),  # what the requeue functions do
        ("UPDATE outbox_inbox_dead SET status = 'requeued', payload = '{}'", "never change its message"),
    ]
    if engine.dialect.name == "postgresql":  # the tables' owner (these tests) is refused as well
        refusals += [
            ("TRUNCATE outbox_inbox", "TRUNCATE is not allowed"),
            ("TRUNCATE outbox_inbox_dead", "TRUNCATE is not allowed"),
        ]
    for statement, why in refusals:
        if why is None:
            with engine.begin() as conn:
                conn.execute(text(statement))
            continue
        with pytest.raises(DBAPIError, match=why), engine.begin() as conn:
            conn.execute(text(statement))
    assert kept(engine) == {("billing", "m1"), ("billing", "m2")}


def test_a_redelivery_after_its_marker_was_purged_is_refused_not_applied(engine):
    keep = timedelta(days=7)
    inbox = Inbox("billing", keep=keep, max_failures=1)
    applied: list[str] = []
    inbox.handler("order.paid", name="bill")(lambda s, msg: applied.append(msg.id))
    sent = datetime.now(UTC)
    message = InboxMessage("m1", "order.paid", {"order": 7}, sent_at=sent)
    assert inbox.process(engine, message).outcome == "handled"

    # Eight days on: the marker's window has passed, the purge takes it, the broker redelivers.
    age_markers(engine, timedelta(days=8))
    assert ops.purge(engine, delivered_older_than=timedelta(days=30)).markers == 1
    late = InboxMessage("m1", "order.paid", {"order": 7}, sent_at=sent - timedelta(days=8), attempt=2)
    with Session(engine) as s, s.begin(), pytest.raises(MessageTooOld):
        inbox.receive(s, late.id, sent_at=late.sent_at)
    result = inbox.process(engine, late)
    assert (result.outcome, type(result.error)) == ("dead", MessageTooOld)
    assert applied == ["m1"]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(dead)).scalar_one() == 1


def test_the_downgrade_keeps_markers_in_their_window_and_dead_letters(empty_url):
    outbox.upgrade(empty_url)
    # Down to the inbox's own revision first: on SQLite a refused downgrade keeps what the
    # later revisions' downgrades already did (see docs/migrations.md), so each refusal below
    # must be the inbox's alone.
    outbox.downgrade(empty_url, "outbox_0020")
    from sqlalchemy import create_engine

    engine = create_engine(empty_url)
    try:
        inbox = Inbox("billing", keep=timedelta(days=1))
        with Session(engine) as s, s.begin():
            inbox.receive(s, "m1")
        with pytest.raises(RuntimeError, match="1 marker\\(s\\) still within their inbox's window"):
            outbox.downgrade(empty_url, "outbox_0019")
        age_markers(engine, timedelta(days=2))
        ops.purge(engine, delivered_older_than=timedelta(days=1))
        with Session(engine) as s, s.begin():
            inbox.dead_letter(s, InboxMessage("m2", "order.paid"), ValueError("no customer"))
        with pytest.raises(RuntimeError, match="1 dead letter\\(s\\)"):
            outbox.downgrade(empty_url, "outbox_0019")
    finally:
        engine.dispose()


def test_outbox_inbox_dead_lists_dead_letters_with_secrets_masked(engine, database_url):
    with Session(engine) as s, s.begin():
        for n, consumer in enumerate(("billing", "billing", "shipping")):
            message = InboxMessage(f"m{n}", "order.paid", {"order": n, "card_token": "tok_4242"})
            Inbox(consumer).dead_letter(s, message, ValueError(f"order {n} has no customer"), attempts=n)
    listed = ok_json(run("inbox", "dead", "--consumer", "billing", "--json", database_url=database_url))
    assert [(x["message_id"], x["attempts"], x["error"]) for x in listed] == [
        ("m1", 1, "order 1 has no customer"),
        ("m0", 0, "order 0 has no customer"),
    ]
    assert listed[0]["payload"] == {"order": 1, "card_token": "***"}
    table = ok(run("inbox", "dead", "--limit", "1", database_url=database_url)).splitlines()
    assert table[0].split()[:3] == ["id", "consumer", "message"] and len(table) == 2
    assert "shipping  m2" in table[1]
    assert ok(run("inbox", "dead", "--consumer", "nobody", database_url=database_url)).strip() == (
        "no dead letter for consumer nobody"
    )


def test_a_disposable_test_database_is_emptied_of_markers_and_dead_letters_too(engine):
    from outbox.testing import reset

    with Session(engine) as s, s.begin():
        Inbox("billing").receive(s, "m1")
        Inbox("billing").dead_letter(s, InboxMessage("m2", "order.paid"), ValueError("no customer"))
        Inbox("billing").store_offset(s, "orders", 0, 5)
    emptied = reset(engine, disposable=True)
    assert {"outbox_inbox", "outbox_inbox_dead", "outbox_inbox_offset"} <= set(emptied)
    assert kept(engine) == set()
    with Session(engine) as s, s.begin():  # the guards are back
        Inbox("billing").receive(s, "m3")
    with pytest.raises(DBAPIError), engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_inbox"))
