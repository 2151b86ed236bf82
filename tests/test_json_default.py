"""``Outbox(json_default=...)`` and ``outbox.json_default``: payload values JSON has no type for."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import ConfigurationError, Message, Outbox, PayloadError, emit, json_default
from outbox.relay import Relay

m = outbox.outbox_message


class Colour(enum.Enum):
    RED = "red"
    DEEP = Decimal("1.5")


@dataclasses.dataclass
class Line:
    sku: str
    price: Decimal
    colour: Colour


@dataclasses.dataclass
class Order:
    id: uuid.UUID
    placed: datetime
    lines: list[Line]
    notes: tuple[str, ...] = ()


class Customer(pydantic.BaseModel):
    id: uuid.UUID
    since: date
    credit: Decimal


ORDER_ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
PLACED = datetime(2026, 3, 1, 9, 30, tzinfo=UTC)


def sessions(engine: Engine, ob: Outbox) -> Iterator[sessionmaker[Session]]:
    factory = sessionmaker(engine)
    ob.install(factory)
    yield factory
    ob.uninstall(factory)


@pytest.fixture
def converting(engine: Engine) -> Iterator[tuple[Outbox, sessionmaker[Session]]]:
    ob = Outbox(json_default=json_default)
    received: list[Message] = []
    ob.route("order.placed", received.append, name="audit")
    ob.received = received  # type: ignore[attr-defined]
    yield from ((ob, factory) for factory in sessions(engine, ob))


def stored(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return [r.payload for r in conn.execute(select(m).order_by(m.c.id))]


def test_the_builtin_default_turns_each_kind_into_json_types():
    assert json_default(Decimal("19.90")) == "19.90"
    assert json_default(Decimal("1E+3")) == "1E+3"  # the exact text, exponent and all
    assert json_default(PLACED) == "2026-03-01T09:30:00+00:00"
    assert json_default(datetime(2026, 3, 1, 9, 30)) == "2026-03-01T09:30:00"  # naive stays naive
    assert json_default(date(2026, 3, 1)) == "2026-03-01"
    assert json_default(time(9, 30, tzinfo=timezone(timedelta(hours=2)))) == "09:30:00+02:00"
    assert json_default(ORDER_ID) == "12345678-1234-5678-1234-567812345678"
    assert json_default(Colour.RED) == "red"
    line = Line("A-1", Decimal("2.50"), Colour.RED)
    assert json_default(line) == {"sku": "A-1", "price": Decimal("2.50"), "colour": Colour.RED}
    customer = Customer(id=ORDER_ID, since=date(2020, 1, 2), credit=Decimal("5.00"))
    assert json_default(customer) == {"id": str(ORDER_ID), "since": "2020-01-02", "credit": "5.00"}
    for unknown in (object(), {1, 2}, b"bytes", Line, Customer):
        with pytest.raises(TypeError, match="is not JSON serializable"):
            json_default(unknown)


def test_the_builtin_default_agrees_with_json_dumps():
    payload = {"total": Decimal("3.10"), "at": PLACED, "id": ORDER_ID, "colour": Colour.DEEP}
    assert json.loads(json.dumps(payload, default=json_default)) == {
        "total": "3.10",
        "at": "2026-03-01T09:30:00+00:00",
        "id": str(ORDER_ID),
        "colour": "1.5",
    }


def test_an_emit_stores_the_converted_payload_and_the_handler_gets_json_types(engine, converting):
    ob, factory = converting
    order = Order(ORDER_ID, PLACED, [Line("A-1", Decimal("2.50"), Colour.RED)], notes=("gift",))
    customer = Customer(id=ORDER_ID, since=date(2020, 1, 2), credit=Decimal("5.00"))
    with factory.begin() as s:
        emit(s, "order.placed", {"order": order, "customer": customer, "total": Decimal("2.50")})
        emit(s, "order.placed", order)  # a payload that converts to an object is one too
    expected = {
        "id": str(ORDER_ID),
        "placed": "2026-03-01T09:30:00+00:00",
        "lines": [{"sku": "A-1", "price": "2.50", "colour": "red"}],
        "notes": ["gift"],
    }
    assert stored(engine) == [
        {
            "order": expected,
            "customer": {"id": str(ORDER_ID), "since": "2020-01-02", "credit": "5.00"},
            "total": "2.50",
        },
        expected,
    ]
    assert Relay(ob, engine).run_until_idle().delivered == 2
    assert [msg.payload["order"]["lines"][0]["price"] for msg in ob.received[:1]] == ["2.50"]
    # The round trip is one way: what comes back is text, parsed again by the handler if it wants.
    assert Decimal(ob.received[0].payload["total"]) == Decimal("2.50")
    assert datetime.fromisoformat(ob.received[1].payload["placed"]) == PLACED
    assert uuid.UUID(ob.received[1].payload["id"]) == ORDER_ID


def test_size_and_depth_are_checked_after_conversion(engine):
    ob = Outbox(json_default=json_default, payload_limit=200, payload_depth_limit=3)
    ob.route("order.placed", lambda msg: None, name="audit")
    factory = next(sessions(engine, ob))
    with factory.begin() as s:
        # A dataclass is a value to the caller, but an object (one level more) once converted.
        line = Line("A-1", Decimal("2.50"), Colour.RED)
        emit(s, "order.placed", {"lines": [line]})  # 3 levels: fine
        with pytest.raises(PayloadError, match="nested 4 levels deep, over the limit of 3"):
            emit(s, "order.placed", {"lines": [{"line": line}]})
        with pytest.raises(PayloadError, match="bytes as JSON, over the limit of 200 bytes"):
            emit(s, "order.placed", {"ids": [uuid.UUID(int=n) for n in range(10)]})
        with pytest.raises(PayloadError, match="contains a NUL"):
            emit(s, "order.placed", {"line": Line("A\x00", Decimal(1), Colour.RED)})
        with pytest.raises(PayloadError, match="JSON object keys must be strings"):
            emit(s, "order.placed", {"by_id": {ORDER_ID: 1}})
    assert stored(engine) == [{"lines": [{"sku": "A-1", "price": "2.50", "colour": "red"}]}]


def test_a_value_still_not_serialisable_is_refused_at_emit_naming_it(engine, converting):
    ob, factory = converting
    with factory.begin() as s:
        with pytest.raises(PayloadError) as refused:
            emit(s, "order.placed", {"order": {"tags": {"a", "b"}}})
        assert str(refused.value) == (
            "payload['order']['tags'] is a set, which is not JSON-serialisable (convert it to JSON "
            "types, or pass Outbox(json_default=...)); json_default=json_default did not convert it "
            "(it raised TypeError)"
        )
        with pytest.raises(PayloadError, match="payload must be a JSON object"):
            emit(s, "order.placed", Colour.RED)  # converts, but to a string
        emit(s, "order.placed", {"ok": True})
    assert stored(engine) == [{"ok": True}]


def test_a_default_that_raises_something_else_is_a_payload_error_naming_where(engine):
    def strict(value: Any) -> Any:
        raise ValueError(f"no {type(value).__name__} here")

    ob = Outbox(json_default=strict)
    ob.route("order.placed", lambda msg: None, name="audit")
    factory = next(sessions(engine, ob))
    with factory.begin() as s:
        with pytest.raises(PayloadError, match=r"payload\['at'\]: json_default=.*strict raised ValueError"):
            emit(s, "order.placed", {"at": PLACED})
        emit(s, "order.placed", {"at": PLACED.isoformat()})  # JSON types never reach it
    assert len(stored(engine)) == 1


def test_a_route_transform_and_validator_see_json_types(engine):
    seen: list[Any] = []

    class Checked:
        def __call__(self, msg: Message) -> None: ...

        def outbox_validate(self, payload: Any) -> None:
            seen.append(payload)

    ob = Outbox(json_default=json_default)
    ob.route("order.placed", Checked(), name="checked")
    ob.route("order.placed", Checked(), name="shaped", transform=lambda p: {**p, "at": PLACED})
    factory = next(sessions(engine, ob))
    with factory.begin() as s:
        emit(s, "order.placed", {"total": Decimal("1.10")})
    assert seen == [{"total": "1.10"}, {"total": "1.10", "at": "2026-03-01T09:30:00+00:00"}]
    assert stored(engine) == seen


def test_without_a_default_the_error_points_at_json_default(engine, ob, maker):
    ob.route("order.placed", lambda msg: None, name="audit")
    with maker.begin() as s:
        converts = ", or let Outbox(json_default=outbox.json_default) convert it)"
        for value, hint in [
            (Decimal("1.5"), "(store str(value)"),
            (PLACED, "(store value.isoformat()"),
            (Colour.RED, "(store value.value"),
            (Line("A", Decimal(1), Colour.RED), "(store a dict of its fields"),
        ]:
            with pytest.raises(PayloadError) as refused:
                emit(s, "order.placed", {"v": value})
            assert f"{hint}{converts}" in str(refused.value)


def test_json_default_must_be_a_plain_callable():
    with pytest.raises(ConfigurationError, match="json_default must be callable"):
        Outbox(json_default="json")  # type: ignore[arg-type]

    async def later(value: Any) -> Any:
        return str(value)

    with pytest.raises(ConfigurationError, match="json_default must be a plain function, not async"):
        Outbox(json_default=later)


def test_the_emitting_guides_json_default_example_prints_what_it_shows(tmp_path):
    found = re.findall(
        r"```python\n(# payloads\.py\n.*?)```\n\n```console\n\$ python payloads\.py\n(.*?)```",
        (Path(__file__).resolve().parents[1] / "docs" / "emitting.md").read_text(),
        re.S,
    )
    assert len(found) == 1, "emitting.md should hold one example '# payloads.py' followed by its output"
    code, output = found[0]
    (tmp_path / "payloads.py").write_text(code)
    run = subprocess.run(
        [sys.executable, "payloads.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == output.splitlines()
