"""The guide's consumer and operator logins run the inbox with their grants, and nothing more.

The consumer writes markers (the database's clock stamps them), dead letters
and offsets, and its handler emits through the application's grants, as the
guide says to grant them; it can neither change nor delete a marker, nor set
when it was received. The operator reads all of it and purges expired markers
through the purge functions, which record the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from aging import age_markers
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.orm import Session, sessionmaker
from test_ops_cli import ok, ok_json, run
from test_roles import Roles, guide_roles, refused

import outbox
from outbox import Inbox, InboxMessage, Outbox, PermanentError, emit, ops

i, dead, runs = outbox.outbox_inbox, outbox.outbox_inbox_dead, outbox.outbox_retention_run
ledger = Table("ledger", MetaData(), Column("id", Integer, primary_key=True), Column("order_id", String(20)))


@pytest.fixture
def roles(pg_url: str) -> Iterator[Roles]:
    yield from guide_roles(pg_url)


def test_the_consumer_takes_messages_in_and_the_operator_purges_their_markers(roles, pg_engine, request):
    consumer_login = roles.names["outbox_consumer"]
    with pg_engine.begin() as conn:
        ledger.create(conn)
        # Its handlers' own table, and emitting as the application does: the application grants these.
        conn.exec_driver_sql(f"GRANT SELECT, INSERT ON ledger TO {consumer_login}")
        conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE ledger_id_seq TO {consumer_login}")
        conn.exec_driver_sql(f"GRANT {roles.names['outbox_app']} TO {consumer_login}")
    consumer = roles.engine("outbox_consumer")
    ob = Outbox()
    ob.route("invoice.requested", lambda msg: None, name="invoicing")
    maker: sessionmaker[Session] = sessionmaker(consumer)
    ob.install(maker)
    request.addfinalizer(lambda: ob.uninstall(maker))
    inbox = Inbox("billing", keep=timedelta(days=1))

    @inbox.handler("order.paid", name="book")
    def book(session: Session, message: InboxMessage) -> None:
        if message.payload["order"] == "bad":
            raise PermanentError("no such customer")
        session.execute(insert(ledger).values(order_id=message.payload["order"]))
        emit(session, "invoice.requested", {"order": message.payload["order"]})

    def store(session: Session) -> None:
        inbox.store_offset(session, "orders", 0, next(offsets))

    offsets = iter(range(1, 10))
    outcomes = [
        inbox.process(maker, InboxMessage(name, "order.paid", {"order": order}), before_commit=store).outcome
        for name, order in (("m1", "7"), ("m1", "7"), ("m2", "bad"), ("m3", "8"))
    ]
    assert outcomes == ["handled", "duplicate", "dead", "handled"]
    assert inbox.stored_offsets(consumer, "orders") == {0: 4}
    with pg_engine.connect() as conn:
        assert sorted(conn.execute(select(ledger.c.order_id)).scalars()) == ["7", "8"]
        assert conn.execute(select(dead.c.message_id, dead.c.error_type)).all() == [
            ("m2", "outbox.PermanentError")
        ]
        database_now = conn.execute(select(func.now())).scalar_one()
        stamps = conn.execute(select(i.c.received_at)).scalars().all()
    assert all(abs(stamp - database_now) < timedelta(minutes=1) for stamp in stamps)

    for statement in (
        "SELECT message_id FROM outbox_inbox",
        "UPDATE outbox_inbox SET outcome = 'handled'",
        "DELETE FROM outbox_inbox",
        "INSERT INTO outbox_inbox (consumer, message_id, outcome, kept_until, received_at)"
        " VALUES ('billing', 'm9', 'received', now() + interval '1 day', now() - interval '9 days')",
        "UPDATE outbox_inbox_dead SET status = 'handled'",
        "DELETE FROM outbox_inbox_dead",
        "SELECT payload FROM outbox_inbox_dead",
        "DELETE FROM outbox_inbox_offset",
        "SELECT outbox_inbox_purge_step(1, 10)",
    ):
        refused(consumer, statement)

    operator = roles.engine("outbox_operator")
    with operator.connect() as conn:
        assert conn.execute(select(func.count()).select_from(i)).scalar_one() == 3
        assert conn.execute(select(dead.c.payload)).scalar_one() == {"order": "bad"}
    listed = ok_json(run("inbox", "dead", "--json", database_url=roles.urls["outbox_operator"]))
    assert [(x["message_id"], x["error"]) for x in listed] == [("m2", "no such customer")]
    refused(operator, "DELETE FROM outbox_inbox")
    refused(
        operator,
        "INSERT INTO outbox_inbox (consumer, message_id, outcome, kept_until)"
        " VALUES ('x', 'y', 'received', now() + interval '1 day')",
    )

    age_markers(pg_engine, timedelta(days=2), message_id="m1")
    result = ops.purge(operator, delivered_older_than=timedelta(days=30))
    assert result.markers == 1
    with pg_engine.connect() as conn:
        assert set(conn.execute(select(i.c.message_id)).scalars()) == {"m2", "m3"}
        record = conn.execute(select(runs)).one()
    assert (record.markers_deleted, record.db_user) == (1, roles.names["outbox_operator"])


def test_the_operator_requeues_and_the_consumer_takes_up_and_neither_can_do_the_others_part(roles, pg_engine):
    consumer_login, operator_login = roles.names["outbox_consumer"], roles.names["outbox_operator"]
    with pg_engine.begin() as conn:
        ledger.create(conn)
        conn.exec_driver_sql(f"GRANT SELECT, INSERT ON ledger TO {consumer_login}")
        conn.exec_driver_sql(f"GRANT USAGE ON SEQUENCE ledger_id_seq TO {consumer_login}")
    consumer, operator = roles.engine("outbox_consumer"), roles.engine("outbox_operator")
    inbox = Inbox("billing")
    ledger_open = False

    @inbox.handler("order.paid", name="book")
    def book(session: Session, message: InboxMessage) -> None:
        session.execute(insert(ledger).values(order_id=message.payload["order"]))
        if not ledger_open:
            raise PermanentError("ledger closed")

    assert inbox.process(consumer, InboxMessage("m1", "order.paid", {"order": "7"})).outcome == "dead"
    with pg_engine.connect() as conn:
        dead_id = conn.execute(select(dead.c.id)).scalar_one()

    # The consumer takes up what an operator requeued; it cannot requeue, nor write a status itself.
    for statement in (
        f"SELECT outbox_inbox_requeue(ARRAY[{dead_id}]::bigint[], 'me', 'why not', true)",
        f"UPDATE outbox_inbox_dead SET status = 'requeued' WHERE id = {dead_id}",
        "SELECT payload FROM outbox_inbox_dead",
    ):
        refused(consumer, statement)
    # The operator requeues; it cannot take a dead letter up, put one back, read one as a consumer
    # does, nor write a status itself.
    for statement in (
        f"SELECT outbox_inbox_take('billing', {dead_id})",
        f"SELECT outbox_inbox_dead_again('billing', {dead_id}, 'E', 'e', true)",
        "SELECT * FROM outbox_inbox_requeued('billing', 10)",
        f"UPDATE outbox_inbox_dead SET status = 'requeued' WHERE id = {dead_id}",
        f"UPDATE outbox_inbox_dead SET status = 'handled' WHERE id = {dead_id}",
    ):
        refused(operator, statement)

    said = ok(
        run(
            "inbox",
            "requeue",
            str(dead_id),
            "--reason",
            "ledger reopens",
            "--actor",
            "ana",
            database_url=roles.urls["outbox_operator"],
        )
    )
    assert said.startswith(f"requeued 1 dead letter(s): {dead_id};")
    [again] = inbox.process_requeued(consumer)
    assert (again.outcome, str(again.error)) == ("dead", "ledger closed")  # put back over its own login

    ops.requeue_inbox_dead_letter(operator, dead_id, actor="ana", reason="now it is open")
    ledger_open = True
    [taken] = inbox.process_requeued(consumer)
    assert taken.outcome == "handled"
    with pg_engine.connect() as conn:
        row = conn.execute(select(dead)).one()
        assert conn.execute(select(ledger.c.order_id)).scalars().all() == ["7"]
    assert (row.status, row.attempts, row.actor, row.reason) == ("handled", 2, "ana", "now it is open")
    assert row.db_user == operator_login  # the login, written by the database beside the actor's label
    refused(operator, f"UPDATE outbox_inbox_dead SET status = 'dead' WHERE id = {dead_id}")
