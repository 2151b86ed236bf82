"""Keys at emit: placeholders filled when the row is written, and no key built from an id not assigned yet."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import ForeignKey, String, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import outbox
from outbox import EmitError, InvalidEmitOption, Outbox, OutboxMixin, PayloadError, emit

m = outbox.outbox_message


class Base(DeclarativeBase):
    pass


class Order(OutboxMixin, Base):
    __tablename__ = "key_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    note: Mapped[str] = mapped_column(String(50), default="")


class Line(OutboxMixin, Base):
    __tablename__ = "key_lines"
    __outbox_aggregate_type__ = "order_line"
    order_id: Mapped[int] = mapped_column(ForeignKey("key_orders.id"), primary_key=True)
    number: Mapped[int] = mapped_column(primary_key=True)


class Ticket(OutboxMixin, Base):
    __tablename__ = "key_tickets"
    code: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: "t" * 30)


@pytest.fixture
def ob() -> Outbox:
    ob = Outbox()
    ob.route("order.placed", lambda msg: None, name="receipt")
    ob.route("order.placed", lambda msg: None, name="warehouse")
    ob.route("line.added", lambda msg: None, name="lines")
    ob.route("ticket.opened", lambda msg: None, name="tickets")
    return ob


@pytest.fixture
def maker(engine: Engine, ob: Outbox) -> Iterator[sessionmaker[Session]]:
    Base.metadata.create_all(engine)
    factory = sessionmaker(engine, expire_on_commit=False)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


def stored(engine: Engine, *columns: str) -> list[tuple[Any, ...]]:
    cols = [m.c[name] for name in columns or ("handler", "idempotency_key", "group_key", "aggregate_id")]
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(*cols).order_by(m.c.id))]


def test_placeholders_are_filled_when_the_row_is_written(engine, maker):
    with maker.begin() as s:
        orders = [Order(), Order()]
        s.add_all(orders)
        for order in orders:  # before the flush: neither has an id yet
            order.emit(
                "order.placed",
                {},
                key="{event_type}:{aggregate_id}",
                group_key="{aggregate_type}/{aggregate_id}",
            )
    first, second = (str(o.id) for o in orders)
    assert stored(engine) == [
        ("receipt", f"order.placed:{first}", f"Order/{first}", first),
        ("warehouse", f"order.placed:{first}", f"Order/{first}", first),
        ("receipt", f"order.placed:{second}", f"Order/{second}", second),
        ("warehouse", f"order.placed:{second}", f"Order/{second}", second),
    ]


def test_a_known_id_is_filled_at_emit_and_the_key_gives_the_event_its_id(engine, maker):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        s.flush()
        by_placeholder = order.emit("order.placed", {}, key="order.placed:{aggregate_id}")
    with maker.begin() as s:
        by_hand = emit(s, "order.placed", {}, key=f"order.placed:{order.id}")  # a retry, written out
    assert by_placeholder == by_hand, "the same key is the same event, however it was written"
    assert stored(engine, "idempotency_key") == [(f"order.placed:{order.id}",)] * 2


def test_a_key_waiting_for_the_id_gets_a_random_event_id_and_still_dedupes(engine, maker):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        first = order.emit("order.placed", {"n": 1}, key="placed:{aggregate_id}")
        second = order.emit("order.placed", {"n": 2}, key="placed:{aggregate_id}")
    assert first != second and uuid.UUID(str(first)).version == 4
    assert stored(engine, "event_id", "payload") == [(first, {"n": 1})] * 2


def test_composite_ids_and_custom_aggregate_types_fill_in_as_they_are_stored(engine, maker):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        s.flush()
        line = Line(order_id=order.id, number=3)
        s.add(line)
        line.emit("line.added", {}, key="{aggregate_type}:{aggregate_id}")
    assert stored(engine, "idempotency_key", "aggregate_type", "aggregate_id") == [
        (f"order_line:{order.id}:3", "order_line", f"{order.id}:3")
    ]


def test_doubled_braces_are_literal_braces(engine, maker):
    with maker.begin() as s:
        emit(s, "order.placed", {}, key="{{literal}}:{event_type}", group_key="{{only}}")
    assert {r[1:3] for r in stored(engine)} == {("{literal}:order.placed", "{only}")}


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("order:{order_id}", "{order_id} is not a placeholder"),
        ("order:{}", "{} is not a placeholder"),
        ("order:{0}", "{0} is not a placeholder"),
        ("order:{aggregate_id.real}", "{aggregate_id.real} is not a placeholder"),
        ("order:{aggregate_id:>8}", "{aggregate_id:>8} takes no conversion or format"),
        ("order:{aggregate_id!r}", "{aggregate_id!r} takes no conversion or format"),
        ("order:{aggregate_id", "is not a valid template (expected '}' before end of string)"),
        ("order:}", "is not a valid template (Single '}' encountered in format string)"),
    ],
)
def test_a_bad_template_is_refused_at_emit_and_the_transaction_carries_on(engine, maker, key, problem):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        for option in ("key", "group_key"):
            with pytest.raises(InvalidEmitOption) as refused:
                order.emit("order.placed", {}, **{option: key})
            assert problem in str(refused.value)
            assert str(refused.value).startswith(f"{option} {key!r}")
            assert "the placeholders are {aggregate_id}, {aggregate_type}, {event_type}" in str(refused.value)
        order.emit("order.placed", {"ok": True})
    assert len(stored(engine)) == 2


def test_aggregate_placeholders_need_an_aggregate(engine, maker):
    with maker.begin() as s:
        for placeholder in ("{aggregate_id}", "{aggregate_type}"):
            with pytest.raises(InvalidEmitOption, match="only an emit from an aggregate has"):
                emit(s, "order.placed", {}, key=f"order:{placeholder}")
        emit(s, "order.placed", {}, key="{event_type}")
    assert {r[1] for r in stored(engine)} == {"order.placed"}


def test_the_column_width_counts_the_filled_in_key(engine, maker):
    with maker.begin() as s:
        with pytest.raises(InvalidEmitOption, match="at most 255 characters with its placeholders filled"):
            emit(s, "order.placed", {}, key="x" * 250 + "{event_type}")
        order = Order()
        s.add(order)
        with pytest.raises(InvalidEmitOption, match="at most 255 characters with its placeholders filled"):
            order.emit("order.placed", {}, key="x" * 255 + "{aggregate_id}")  # no id is shorter than 1
    with pytest.raises(EmitError, match="is 256 characters once {aggregate_id} is filled in"):
        with maker.begin() as s:
            ticket = Ticket()  # its code is made at the flush
            s.add(ticket)
            ticket.emit("ticket.opened", {}, key="x" * 226 + "{aggregate_id}")
    assert stored(engine) == []


# -- an id that does not exist yet ---------------------------------------------------------------


def test_the_issues_key_is_refused_before_it_drops_every_later_order(engine, maker):
    with maker.begin() as s:
        for _ in range(3):
            order = Order()
            s.add(order)
            with pytest.raises(InvalidEmitOption) as refused:
                order.emit("order.placed", {}, key=f"order.placed:{order.id}")
            assert str(refused.value) == (
                "key 'order.placed:None' has 'None' where this Order has no id yet (the database "
                "assigns it when the Order is flushed), so every Order would share this key: write "
                "{aggregate_id}, filled in when the row is written (key='order.placed:{aggregate_id}'), "
                "or flush before emitting"
            )
            order.emit("order.placed", {}, key="order.placed:{aggregate_id}")
    keys = [r[1] for r in stored(engine)]
    assert len(keys) == 6 and len(set(keys)) == 3 and "order.placed:None" not in keys


@pytest.mark.parametrize(
    "key",
    ["order:None", "None", "None:order", "order-None-x", "order_None", "{event_type}/None", "{{None}}"],
)
def test_a_none_word_in_a_key_or_group_key_is_refused_while_the_id_is_unset(engine, maker, key):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        for option in ("key", "group_key"):
            with pytest.raises(InvalidEmitOption, match=r"write \{aggregate_id\}"):
                order.emit("order.placed", {}, **{option: key})
        s.flush()
        order.emit("order.placed", {}, key=key)  # the id is known now: the text is the caller's own
    assert len(stored(engine)) == 2


@pytest.mark.parametrize("key", ["NoneSuch:1", "order:Nones", "xNone", "None1", "order:{aggregate_id}"])
def test_none_inside_a_word_is_not_an_unset_id(engine, maker, key):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        order.emit("order.placed", {}, key=key, group_key=key)
    assert len(stored(engine)) == 2


def test_a_plain_emit_is_not_second_guessed(engine, maker):
    with maker.begin() as s:
        emit(s, "order.placed", {"parent": None}, key="export:None")  # no aggregate: the caller's text
    assert len(stored(engine)) == 2


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"order_id": None}, "payload['order_id'] is None"),
        ({"id": None}, "payload['id'] is None"),
        ({"orderId": None}, "payload['orderId'] is None"),
        ({"order": {"order_id": "None"}}, "payload['order']['order_id'] is 'None'"),
        ({"url": "https://shop.example/orders/None/receipt"}, "payload['url'] is 'https://shop"),
        ({"lines": [{"ref": "order:None"}]}, "payload['lines'][0]['ref'] is 'order:None'"),
    ],
)
def test_a_payload_holding_the_unset_id_is_refused(engine, maker, payload, where):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        with pytest.raises(PayloadError) as refused:
            order.emit("order.placed", payload)
        assert str(refused.value).startswith(where)
        assert "msg.aggregate_id" in str(refused.value)
        s.flush()
        order.emit("order.placed", {"order_id": order.id})
    assert len(stored(engine)) == 2


@pytest.mark.parametrize(
    "payload",
    [
        {"parent_id": None, "coupon": None},  # not this order's id
        {"note": "None of the items shipped"},  # prose
        {"status": "None"},  # not under an id's name
        {"order_id": 7},
        {},
    ],
)
def test_nulls_and_nones_that_are_not_the_id_pass(engine, maker, payload):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        order.emit("order.placed", payload)
    assert len(stored(engine)) == 2


def test_a_composite_key_checks_only_the_part_that_is_unset(engine, maker):
    with maker.begin() as s:
        order = Order()
        s.add(order)
        s.flush()
        line = Line(order_id=order.id)  # number unset: assigned... never, so it is set before the flush
        s.add(line)
        with pytest.raises(PayloadError, match=r"payload\['number'\] is None"):
            line.emit("line.added", {"order_id": order.id, "number": None})
        with pytest.raises(PayloadError, match=r"payload\['order_line_number'\] is None"):
            line.emit("line.added", {"order_line_number": None})
        line.emit("line.added", {"order_id": order.id, "note": None})
        line.number = 1
    assert len(stored(engine)) == 1


# -- the property: aggregates never share a key they did not write ------------------------------------

STEPS = st.lists(
    st.one_of(
        st.just(("new",)),
        st.just(("flush",)),
        st.just(("commit",)),
        st.just(("rollback",)),
        st.tuples(st.just("emit"), st.integers(0, 7), st.sampled_from(["placeholder", "written", "literal"])),
    ),
    max_size=30,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=STEPS)
def test_two_aggregates_never_share_a_stored_key_unless_written_as_the_same_literal(engine, maker, steps):
    """Emits before and after flushes, across commits and rollbacks, with keys written every way.

    ``placeholder``: ``{aggregate_id}``; ``written``: the id put in by hand
    (``f"...:{order.id}"``), refused while the id is unset; ``literal``: one
    key shared on purpose. Each example has its own key prefix, so the
    examples sharing the database never meet.
    """
    prefix = uuid.uuid4().hex[:8]
    orders: list[Order] = []  # usable aggregates: pending in this transaction, or committed
    accepted: list[tuple[Order, str, str]] = []  # (aggregate, style, key text as written)
    this_transaction: list[tuple[Order, str, str]] = []
    created_now: list[Order] = []
    with maker() as s:
        s.begin()
        for step in [*steps, ("commit",)]:
            if step[0] == "new":
                order = Order()
                s.add(order)
                orders.append(order)
                created_now.append(order)
            elif step[0] == "flush":
                s.flush()
            elif step[0] == "commit":
                s.commit()
                accepted += this_transaction
                this_transaction, created_now = [], []
                s.begin()
            elif step[0] == "rollback":
                s.rollback()
                orders = [o for o in orders if o not in created_now]
                this_transaction, created_now = [], []
                s.begin()
            elif orders:
                order = orders[step[1] % len(orders)]
                style = step[2]
                written = {
                    "placeholder": f"{prefix}:placed:{{aggregate_id}}",
                    "written": f"{prefix}:placed:{order.id}",
                    "literal": f"{prefix}:daily",
                }[style]
                if style == "written" and order.id is None:
                    with pytest.raises(InvalidEmitOption, match=r"write \{aggregate_id\}"):
                        order.emit("order.placed", {}, key=written, group_key=written)
                    continue
                order.emit("order.placed", {}, key=written, group_key=written)
                this_transaction.append((order, style, written))
        # What each accepted emit's key is with every id known, read before the session ends.
        by_key: dict[str, list[tuple[int, str]]] = {}
        for order, style, written in accepted:
            key = f"{prefix}:placed:{order.id}" if style == "placeholder" else written
            by_key.setdefault(key, []).append((order.id, style))
    with engine.connect() as conn:
        stored = conn.execute(
            select(m.c.idempotency_key, m.c.group_key, m.c.aggregate_id)
            .where(m.c.handler == "receipt", m.c.idempotency_key.startswith(prefix))
            .order_by(m.c.id)
        ).all()
    assert sorted(key for key, _, _ in stored) == sorted(by_key), "each key stored once, none lost"
    for key, group_key, aggregate_id in stored:
        assert "None" not in key and "None" not in group_key
        emitters = by_key[key]
        if len({order_id for order_id, _ in emitters}) > 1:
            assert {style for _, style in emitters} == {"literal"}, f"{key} is shared by aggregates"
        else:
            assert aggregate_id == str(emitters[0][0])
            assert group_key == key
