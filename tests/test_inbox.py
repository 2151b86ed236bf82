"""The inbox on SQLite and PostgreSQL: markers, handlers in one transaction with them, failures, dead letters.

Every effect a handler has is a row in ``effects`` (no unique constraint, so a
second application of a message would show as a second row) and, where the
handler emits, an ``outbox_message`` row: consume and emit commit together or
not at all.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

import outbox
from outbox import (
    AckFailed,
    ConfigurationError,
    HandlerFailed,
    Inbox,
    InboxMessage,
    InvalidInboxMessage,
    MessageTooOld,
    NoInboxHandler,
    Outbox,
    PermanentError,
    emit,
)

i, dead, m = outbox.outbox_inbox, outbox.outbox_inbox_dead, outbox.outbox_message
effects = Table(
    "effects",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("message_id", String(255), nullable=False),
    Column("handler", String(50), nullable=False),
)


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __table__ = effects


@pytest.fixture
def maker(engine: Engine) -> Iterator[sessionmaker[Session]]:
    """Sessions with an Outbox installed that routes the inbox's follow-up event."""
    effects.create(engine)
    ob = Outbox()
    ob.route("invoice.requested", lambda msg: None, name="invoicing")
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def applied(session: Session, message: InboxMessage, handler: str = "bill") -> None:
    session.execute(insert(effects).values(message_id=message.id, handler=handler))


def billing(**options: Any) -> Inbox:
    """An inbox whose ``order.paid`` handler records its effect and emits the follow-up event."""
    inbox = Inbox("billing", **options)

    @inbox.handler("order.paid", name="bill")
    def bill(session: Session, message: InboxMessage) -> None:
        applied(session, message)
        emit(session, "invoice.requested", {"order": message.payload["order"]})

    return inbox


def count(engine: Engine, table: Table, **where: Any) -> int:
    with engine.connect() as conn:
        query = select(func.count()).select_from(table)
        for column, value in where.items():
            query = query.where(table.c[column] == value)
        return int(conn.execute(query).scalar_one())


def markers(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(i.c.message_id, i.c.outcome)).all())


def paid(message_id: str = "m1", **fields: Any) -> InboxMessage:
    return InboxMessage(message_id, "order.paid", {"order": 7}, **fields)


# -- receive -------------------------------------------------------------------------------------


def test_receive_is_true_the_first_time_and_false_for_a_duplicate(engine):
    inbox = Inbox("billing")
    with Session(engine) as s, s.begin():
        assert inbox.receive(s, "m1") is True
        assert inbox.receive(s, "m1") is False  # within the same transaction too
    with Session(engine) as s, s.begin():
        assert inbox.receive(s, "m1") is False
        assert Inbox("shipping").receive(s, "m1") is True  # each consumer takes it once
    assert count(engine, i) == 2


def test_a_rolled_back_receive_leaves_no_marker(engine):
    inbox = Inbox("billing")
    with Session(engine) as s:
        with s.begin():
            assert inbox.receive(s, "m1")
            s.rollback()
        with s.begin():
            assert inbox.receive(s, "m1")  # the rollback took the marker with it
    assert markers(engine) == {"m1": "received"}


def test_the_marker_records_the_window_and_where_it_came_from(engine):
    inbox = Inbox("billing", keep=timedelta(hours=3))
    before = datetime.now(UTC) - timedelta(seconds=5)  # the database clock may differ a little
    with Session(engine) as s, s.begin():
        inbox.receive(s, uuid.UUID(int=5), event_type="order.paid", source="rabbitmq:orders")
        inbox.receive(s.connection(), 42)  # a Connection does too; an int is taken as its text
    with engine.connect() as conn:
        rows = {r.message_id: r for r in conn.execute(select(i))}
    marker = rows[str(uuid.UUID(int=5))]
    assert (marker.consumer, marker.event_type, marker.source, marker.outcome) == (
        "billing",
        "order.paid",
        "rabbitmq:orders",
        "received",
    )
    assert marker.received_at >= before and marker.kept_until - marker.received_at == timedelta(hours=3)
    assert rows["42"].event_type is None


@pytest.mark.parametrize(
    ("message_id", "why"),
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("x" * 256, "at most 255 characters"),
        ("a\x00b", "NUL"),
        (b"m1", "decode it first"),
        (1.5, "string, UUID or int"),
        (True, "string, UUID or int"),
        (None, "string, UUID or int"),
    ],
)
def test_a_bad_message_id_is_refused_before_anything_is_written(engine, message_id, why):
    inbox = Inbox("billing")
    with Session(engine) as s, s.begin():
        with pytest.raises(InvalidInboxMessage, match=why):
            inbox.receive(s, message_id)
        assert inbox.receive(s, "m1")  # the transaction is still usable
    assert markers(engine) == {"m1": "received"}


def test_receive_names_its_async_twin_for_an_async_session(engine):
    from sqlalchemy.ext.asyncio import AsyncSession

    inbox = Inbox("billing")
    with pytest.raises(TypeError, match=r"await inbox\.areceive"):
        inbox.receive(AsyncSession(), "m1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process\(\) takes a sessionmaker or an Engine"):
        inbox.process("sqlite://", paid())  # type: ignore[arg-type]


def test_a_message_sent_before_the_window_is_refused_not_applied(engine):
    inbox = Inbox("billing", keep=timedelta(days=1))
    with Session(engine) as s, s.begin():
        with pytest.raises(MessageTooOld, match=r"sent at .* longer than the 1 day, 0:00:00 it keeps"):
            inbox.receive(s, "late", sent_at=datetime.now(UTC) - timedelta(days=1, minutes=1))
        assert inbox.receive(s, "fresh", sent_at=datetime.now(UTC) - timedelta(hours=23))
        with pytest.raises(InvalidInboxMessage, match="aware datetime"):
            inbox.receive(s, "naive", sent_at=datetime.now() - timedelta(hours=1))  # noqa: DTZ005
    assert markers(engine) == {"fresh": "received"}


# -- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"keep": timedelta(0)}, "keep must be a positive timedelta"),
        ({"keep": 3600}, "keep must be a positive timedelta"),
        ({"keep": timedelta(days=4000)}, "at most 3650 days"),
        ({"max_failures": 0}, "max_failures must be an int of at least 1"),
        ({"unhandled": "drop"}, "unhandled must be 'dead_letter' or 'skip'"),
    ],
)
def test_bad_settings_are_refused_at_once(options, why):
    with pytest.raises(ConfigurationError, match=why):
        Inbox("billing", **options)


def test_bad_handlers_are_refused_at_registration():
    inbox = Inbox("billing")
    with pytest.raises(ConfigurationError, match="inbox name"):
        Inbox("two words")
    with pytest.raises(ConfigurationError, match="wildcards only as a whole"):
        inbox.handler("order.pa*", name="x")(lambda s, msg: None)
    inbox.handler("order.paid", name="bill")(lambda s, msg: None)
    with pytest.raises(ConfigurationError, match="has a handler named 'bill' already"):
        inbox.handler("order.refunded", name="bill")(lambda s, msg: None)


# -- process -------------------------------------------------------------------------------------


def test_process_applies_once_and_acknowledges_after_the_commit(engine, maker):
    inbox = billing()
    seen_at_ack: list[dict[str, str]] = []

    def ack() -> None:  # runs after the commit: another connection sees the marker and the event
        seen_at_ack.append(markers(engine))
        assert count(engine, m) == len(seen_at_ack)

    first = inbox.process(maker, paid(), ack=ack)
    again = inbox.process(maker, paid(attempt=2), ack=lambda: seen_at_ack.append(markers(engine)))
    assert (first.outcome, first.handlers, first.duplicate) == ("handled", ("bill",), False)
    assert (again.outcome, again.handlers, again.duplicate) == ("duplicate", (), True)
    assert seen_at_ack == [{"m1": "handled"}] * 2
    assert count(engine, effects) == 1
    assert count(engine, m, event_type="invoice.requested") == 1


def test_a_failing_handler_rolls_back_the_marker_and_what_it_emitted(engine, maker):
    inbox = billing()
    broken = True

    @inbox.handler("order.*", name="audit")
    def audit(session: Session, message: InboxMessage) -> None:
        applied(session, message, "audit")
        if broken:
            raise RuntimeError("ledger unreachable")

    acks: list[str] = []
    with pytest.raises(HandlerFailed, match="handler 'audit' failed: RuntimeError: ledger unreachable") as e:
        inbox.process(maker, paid(), ack=lambda: acks.append("acked"))
    assert (e.value.handler, e.value.message.id, type(e.value.__cause__)) == ("audit", "m1", RuntimeError)
    assert (acks, markers(engine), count(engine, effects), count(engine, m)) == ([], {}, 0, 0)

    broken = False  # the redelivery runs every handler again, this time to the end
    assert inbox.process(maker, paid(attempt=2), ack=lambda: acks.append("acked")).outcome == "handled"
    assert (acks, count(engine, effects), count(engine, m)) == (["acked"], 2, 1)


def test_an_error_flushing_the_handlers_changes_counts_against_the_message(engine, maker):
    inbox = Inbox("billing")

    @inbox.handler("order.paid", name="orm")
    def orm(session: Session, message: InboxMessage) -> None:
        session.add(Effect(message_id=None, handler="orm"))  # NOT NULL: refused at the flush

    with pytest.raises(HandlerFailed, match="writing the handlers' changes failed") as e:
        inbox.process(maker, paid())
    assert e.value.handler is None
    assert markers(engine) == {}


def test_the_last_failure_becomes_a_dead_letter_with_its_marker(engine, maker):
    inbox = billing(max_failures=3)

    @inbox.handler("order.paid", name="refuse")
    def refuse(session: Session, message: InboxMessage) -> None:
        raise ValueError(f"order {message.payload['order']} has no customer")

    for attempt in (1, 2):
        with pytest.raises(HandlerFailed):
            inbox.process(maker, paid(attempt=attempt))
    acks: list[int] = []
    buried = inbox.process(
        maker,
        paid(attempt=3, headers={"trace": "t1"}, source="rabbitmq:orders"),
        ack=lambda: acks.append(count(engine, dead)),
    )
    assert (buried.outcome, buried.handlers, type(buried.error)) == ("dead", ("bill", "refuse"), ValueError)
    assert acks == [1]  # recorded before it was acknowledged
    assert markers(engine) == {"m1": "dead"}
    assert (count(engine, effects), count(engine, m)) == (0, 0)  # nothing of the failed runs
    with engine.connect() as conn:
        letter = conn.execute(select(dead)).one()
    assert letter.id == buried.dead_letter_id
    assert (letter.consumer, letter.message_id, letter.event_type, letter.source, letter.status) == (
        "billing",
        "m1",
        "order.paid",
        "rabbitmq:orders",
        "dead",
    )
    assert (letter.payload, letter.headers, letter.attempts) == ({"order": 7}, {"trace": "t1"}, 3)
    assert (letter.error_type, letter.error) == ("ValueError", "order 7 has no customer")
    # A redelivery after that is a duplicate: the operator decides, not the broker.
    assert inbox.process(maker, paid(attempt=4)).outcome == "duplicate"


def test_a_permanent_error_is_a_dead_letter_at_the_first_attempt(engine, maker):
    inbox = Inbox("billing")

    @inbox.handler("order.paid", name="refuse")
    def refuse(session: Session, message: InboxMessage) -> None:
        raise PermanentError("unknown currency XYZ")

    result = inbox.process(maker, paid())
    assert (result.outcome, str(result.error)) == ("dead", "unknown currency XYZ")
    with engine.connect() as conn:
        assert conn.execute(select(dead.c.error_type, dead.c.attempts)).one() == ("outbox.PermanentError", 1)


def test_max_failures_none_leaves_every_failure_to_the_caller(engine, maker):
    inbox = Inbox("billing", max_failures=None)
    inbox.handler("order.paid", name="refuse")(lambda s, msg: 1 / 0)
    with pytest.raises(HandlerFailed):
        inbox.process(maker, paid(attempt=1000))
    assert count(engine, dead) == 0


def test_a_message_no_handler_takes_is_a_dead_letter_unless_the_inbox_skips_them(engine, maker):
    inbox = billing()
    result = inbox.process(maker, InboxMessage("r1", "order.refunded", {"order": 7}))
    assert result.outcome == "dead" and isinstance(result.error, NoInboxHandler)
    assert "register one with @inbox.handler('order.refunded')" in str(result.error)
    with engine.connect() as conn:
        assert conn.execute(select(dead.c.error_type, dead.c.attempts)).one() == ("outbox.NoInboxHandler", 0)

    skipping = Inbox("shipping", unhandled="skip")
    assert skipping.process(maker, InboxMessage("r1", "order.refunded")).outcome == "unhandled"
    assert skipping.process(maker, InboxMessage("r1", "order.refunded")).outcome == "duplicate"
    with engine.connect() as conn:
        assert conn.execute(select(i.c.consumer, i.c.outcome).order_by(i.c.consumer)).all() == [
            ("billing", "dead"),
            ("shipping", "unhandled"),
        ]


def test_a_message_too_old_for_the_window_is_a_dead_letter_and_acknowledged(engine, maker):
    inbox = billing(keep=timedelta(days=2))
    acks: list[str] = []
    result = inbox.process(
        maker, paid(sent_at=datetime.now(UTC) - timedelta(days=3)), ack=lambda: acks.append("a")
    )
    assert result.outcome == "dead" and isinstance(result.error, MessageTooOld)
    assert (acks, markers(engine), count(engine, effects)) == (["a"], {"m1": "dead"}, 0)
    with engine.connect() as conn:
        assert conn.execute(select(dead.c.error_type)).scalar_one() == "outbox.MessageTooOld"


def test_wildcard_handlers_all_run_in_registration_order(engine, maker):
    inbox = Inbox("audit")
    order: list[str] = []
    for pattern, name in (
        ("#", "everything"),
        ("order.*", "orders"),
        ("order.#", "deep"),
        ("*.paid", "paid"),
    ):
        inbox.handler(pattern, name=name)(lambda s, msg, name=name: order.append(name))
    assert inbox.process(maker, InboxMessage("x", "order.paid")).handlers == (
        "everything",
        "orders",
        "deep",
        "paid",
    )
    assert inbox.process(maker, InboxMessage("y", "order.paid.late")).handlers == ("everything", "deep")
    assert [h.name for h in inbox.handlers_for("invoice.sent")] == ["everything"]
    assert order == ["everything", "orders", "deep", "paid", "everything", "deep"]


def test_before_commit_runs_in_the_same_transaction_for_every_outcome(engine, maker):
    inbox = billing()
    position = iter(range(1, 100))

    def store(session: Session) -> None:
        inbox.store_offset(session, "orders", 0, next(position))

    inbox.process(maker, paid("m1"), before_commit=store)
    inbox.process(maker, paid("m1"), before_commit=store)  # a duplicate still moves the position on
    inbox.process(maker, InboxMessage("r1", "order.refunded"), before_commit=store)  # a dead letter too
    assert inbox.stored_offsets(engine, "orders") == {0: 3}

    def fail(session: Session) -> None:
        raise OSError("offset store down")

    with pytest.raises(OSError, match="offset store down"):  # not the message's fault: raised as it is
        inbox.process(maker, paid("m2"), before_commit=fail)
    assert "m2" not in markers(engine)


def test_offsets_never_move_backwards_and_are_kept_per_partition(engine, maker):
    inbox = Inbox("billing")
    with maker.begin() as s:
        inbox.store_offset(s, "orders", 0, 10)
        inbox.store_offset(s, "orders", 0, 4)  # a late write of a consumer that lost the partition
        inbox.store_offset(s, "orders", 3, 1)
        Inbox("other").store_offset(s, "orders", 0, 99)
    with maker() as s:
        assert inbox.stored_offsets(s, "orders") == {0: 10, 3: 1}
    assert inbox.stored_offsets(engine, "invoices") == {}
    with maker.begin() as s, pytest.raises(InvalidInboxMessage, match="next_offset must be an int"):
        inbox.store_offset(s, "orders", 0, -1)


def test_an_acknowledgement_that_fails_leaves_the_outcome_committed(engine, maker):
    inbox = billing()

    def ack() -> None:
        raise ConnectionError("channel closed")

    with pytest.raises(AckFailed, match="handled and committed, but acknowledging it failed") as e:
        inbox.process(maker, paid(), ack=ack)
    assert e.value.result.outcome == "handled" and count(engine, effects) == 1
    assert inbox.process(maker, paid(attempt=2)).duplicate


def test_process_refuses_async_handlers_and_names_aprocess(engine, maker):
    inbox = Inbox("billing")

    @inbox.handler("order.paid", name="async_bill")
    async def async_bill(session: Any, message: InboxMessage) -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"await inbox\.aprocess"):
        inbox.process(maker, paid())
    assert markers(engine) == {}


def test_dead_letter_records_what_a_source_could_not_decode(engine):
    inbox = Inbox("billing")
    garbled = InboxMessage("m9", "order.paid", payload=b"\xff\x00 not json", attempt=1)
    with Session(engine) as s, s.begin():
        letter = inbox.dead_letter(s, garbled, ValueError("not UTF-8 JSON"))
        assert inbox.dead_letter(s, garbled, ValueError("again")) is None  # its marker is there now
    with engine.connect() as conn:
        row = conn.execute(select(dead)).one()
    assert (row.id, row.payload, row.error_type) == (letter, repr(b"\xff\x00 not json"), "ValueError")
    assert markers(engine) == {"m9": "dead"}
