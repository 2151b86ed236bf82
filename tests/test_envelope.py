"""The CloudEvents envelope shared by the broker publishers: what a consumer reads in headers and body."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import ConfigurationError, Message, Outbox, PermanentError, emit, ops
from outbox.integrations._envelope import RoutingTemplate, envelope
from outbox.relay import Relay


def message(**kw: object) -> Message:
    fields: dict[str, object] = {
        "id": 7,
        "event_id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "event_type": "order.paid",
        "handler": "orders_to_rabbit",
        "payload": {"order_id": 42, "note": "naïve"},
        "headers": {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "x": "y"},
        "aggregate_type": "order",
        "aggregate_id": "42",
        "created_at": datetime(2026, 12, 4, 10, 0, 1, tzinfo=UTC),
    }
    fields.update(kw)
    return Message(**fields)  # type: ignore[arg-type]


def test_binary_mode_attributes_body_and_key():
    env = envelope(message())
    assert env.headers == {
        "ce-specversion": "1.0",
        "ce-id": "12345678-1234-5678-1234-567812345678",
        "ce-type": "order.paid",
        "ce-source": "urn:sqlalchemy-outbox:orders_to_rabbit",
        "ce-time": "2026-12-04T10:00:01Z",
        "ce-subject": "order/42",
        "content-type": "application/json",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    assert json.loads(env.body) == {"order_id": 42, "note": "naïve"}
    assert env.key == "42"
    assert env.dedupe_id == "12345678-1234-5678-1234-567812345678:orders_to_rabbit"


def test_a_requeued_copy_is_the_same_event_to_consumers():
    original, copy = message(id=7, attempt=3), message(id=99, attempt=1)
    assert envelope(original).headers == envelope(copy).headers
    assert envelope(original).dedupe_id == envelope(copy).dedupe_id


def test_a_copys_ce_time_is_when_the_copy_was_made_and_the_rest_is_the_events(engine):
    """As docs/brokers.md says: a requeued copy is the same event, stored again later."""
    published: list[tuple[int, dict[str, str], bytes]] = []

    def publish(msg: Message) -> None:
        env = envelope(msg)
        published.append((msg.id, env.headers, env.body))
        if len(published) == 1:
            raise PermanentError("the broker refused it")

    ob = Outbox()
    ob.route("order.paid", publish, name="orders_broker")
    maker = sessionmaker(engine)
    ob.install(maker)
    with maker.begin() as s:
        emit(s, "order.paid", {"order_id": 42}, key="order.paid:42")
    Relay(ob, engine).run_until_idle()  # dead
    ((original_id, copy_id),) = ops.requeue(engine, ops.MessageFilter(ids=[1]), reason="fixed", actor="ops")
    Relay(ob, engine).run_until_idle()  # the copy is delivered

    m = outbox.outbox_message
    with engine.connect() as conn:
        stored = dict(conn.execute(select(m.c.id, m.c.created_at)).all())
    (first_id, first, first_body), (second_id, second, second_body) = published
    assert (first_id, second_id) == (original_id, copy_id)
    for message_id, headers in ((first_id, first), (second_id, second)):
        created = stored[message_id].replace(tzinfo=UTC)
        assert datetime.fromisoformat(headers["ce-time"]) == created
    assert stored[copy_id] > stored[original_id]
    assert {k: v for k, v in first.items() if k != "ce-time"} == {
        k: v for k, v in second.items() if k != "ce-time"
    }
    assert first_body == second_body


def test_routing_templates_are_checked_when_built_and_filled_per_message():
    assert RoutingTemplate("events.{aggregate_type}.{event_type}", "routing key").render(message()) == (
        "events.order.order.paid"
    )
    for bad, problem in (
        ("{nope}", "is not one of"),
        ("{event_type!r}", "is not one of"),
        ("{", "Single '{' encountered"),
    ):
        with pytest.raises(ConfigurationError, match=problem):
            RoutingTemplate(bad, "routing key")
    with pytest.raises(PermanentError, match="needs aggregate_type"):
        RoutingTemplate("{aggregate_type}", "subject").render(message(aggregate_type=None))
