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
from test_ops_cli import ok_json, run
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
