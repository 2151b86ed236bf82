"""Receiving webhooks exactly once (outbox.integrations.webhook.receive), on SQLite and PostgreSQL.

Requests are signed for real with the sender's signing code; the receiver's
database is a real one, and a database error is a real one too (a database
without the outbox's tables, a port nothing listens on). The examples over
real HTTP, with the relay as the sender, are in test_webhook_receive_examples.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, func, insert, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import ConfigurationError, Inbox, InboxMessage, PermanentError
from outbox.integrations._signing import parse_secrets, sign
from outbox.integrations.webhook import WebhookReceipt, WebhookReceiver, areceive, receive

SECRET = "whsec_" + base64.b64encode(b"r" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()
WRONG_SECRET = "whsec_" + base64.b64encode(b"w" * 32).decode()
ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg_async"}

markers, dead = outbox.outbox_inbox, outbox.outbox_inbox_dead
payments = Table(
    "payments",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("message_id", String(255), nullable=False),
    Column("order_id", Integer, nullable=False),
)


def signed(
    body: bytes, msg_id: str = "msg_1", *, secret: str = SECRET, at: int | None = None, **extra: str
) -> dict[str, str]:
    """The headers a Standard Webhooks sender sends with ``body``."""
    stamp = int(time.time()) if at is None else at
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(parse_secrets(secret), msg_id, stamp, body),
        **extra,
    }


def order(order_id: int = 7, **fields: Any) -> bytes:
    return json.dumps({"order_id": order_id, **fields}).encode()


class Payments:
    """An inbox whose handler records a payment, and can be told to fail its next calls."""

    def __init__(self, **options: Any) -> None:
        self.inbox = Inbox("partner_payments", **options)
        self.failures: list[BaseException] = []
        self.seen: list[InboxMessage] = []

        @self.inbox.handler("order.paid", name="record_payment")
        def record_payment(session: Session, message: InboxMessage) -> None:
            self.seen.append(message)
            session.execute(
                insert(payments).values(message_id=message.id, order_id=message.payload["order_id"])
            )
            if self.failures:
                raise self.failures.pop(0)


def stored(engine: Engine) -> tuple[int, int, int]:
    """(markers, dead letters, payments) in the receiver's database."""
    with engine.connect() as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(select(func.count()).select_from(t)).scalar_one() for t in (markers, dead, payments)
        )


@pytest.fixture
def sessions(engine: Engine) -> sessionmaker[Session]:
    payments.create(engine)
    return sessionmaker(engine)


@pytest.fixture
def shop() -> Payments:
    return Payments()


def test_an_authentic_webhook_takes_effect_once_and_every_repeat_is_answered_200(engine, sessions, shop):
    body = order(7)
    at = int(time.time())
    headers = signed(body, at=at, authorization="Bearer sk_live_abc", **{"x-sender": "billing"})

    first = receive(shop.inbox, sessions, body=body, headers=headers, secret=SECRET, event_type="order.paid")
    assert (first.status_code, first.reason) == (200, "handled")
    assert first.processed is not None and first.processed.handlers == ("record_payment",)
    orders = WebhookReceiver(shop.inbox, sessions, secret=SECRET, event_type="order.paid")
    again = orders.receive(body, headers)  # the sender's first answer was lost: it sends again
    later = orders.receive(body, signed(body))  # a resend, signed anew, with the same webhook-id
    assert [r.status_code for r in (again, later)] == [200, 200]
    assert again.processed is not None and again.processed.duplicate
    assert stored(engine) == (1, 0, 1)

    (message,) = shop.seen
    assert message.id == "msg_1"
    assert message.event_type == "order.paid"
    assert message.payload == {"order_id": 7}
    assert message.source == "webhook"
    assert message.sent_at == datetime.fromtimestamp(at, UTC)
    # Kept with the message (a dead letter stores them): never the signature, never a credential.
    assert message.headers == {
        "content-type": "application/json",
        "webhook-id": "msg_1",
        "webhook-timestamp": str(at),
        "x-sender": "billing",
    }
    with engine.connect() as conn:
        row = conn.execute(select(markers)).one()
    assert (row.consumer, row.message_id, row.event_type, row.source, row.outcome) == (
        "partner_payments",
        "msg_1",
        "order.paid",
        "webhook",
        "handled",
    )


def test_the_event_type_is_the_endpoints_or_else_the_bodys_type(engine, sessions):
    inbox = Inbox("notes")
    seen: list[InboxMessage] = []
    inbox.handler("order.paid", name="order_paid")(lambda session, message: seen.append(message))
    inbox.handler("invoice.sent", name="invoice_sent")(lambda session, message: seen.append(message))
    envelope = {"type": "order.paid", "timestamp": "2024-05-01T10:00:00Z", "data": {"order_id": 7}}
    body = json.dumps(envelope).encode()

    by_body = receive(inbox, sessions, body=body, headers=signed(body, "msg_a"), secret=SECRET)
    # An endpoint for one type names it, whatever the body says.
    by_endpoint = receive(
        inbox,
        sessions,
        body=body,
        headers=signed(body, "msg_b"),
        secret=SECRET,
        event_type="invoice.sent",
        source="webhook:invoices",
    )
    assert [by_body.reason, by_endpoint.reason] == ["handled", "handled"]
    assert [(m.id, m.event_type, m.source) for m in seen] == [
        ("msg_a", "order.paid", "webhook"),
        ("msg_b", "invoice.sent", "webhook:invoices"),
    ]
    assert seen[0].payload == seen[1].payload == envelope  # the whole body, as sent


@pytest.mark.parametrize(
    "request_of, complaint",
    [  # signed when the test runs, not when it is collected: the timestamps must be fresh
        (lambda: (order(7), signed(order(7), secret=WRONG_SECRET)), "no signature matches"),
        (lambda: (order(8), signed(order(7))), "no signature matches"),  # altered body
        (lambda: (order(7), {**signed(order(7)), "webhook-id": "msg_2"}), "no signature matches"),
        (lambda: (order(7), {**signed(order(7)), "webhook-signature": ""}), "missing"),
        (
            lambda: (order(7), signed(order(7), at=int(time.time()) - 3600)),
            "s old (tolerance 300s)",
        ),  # a late replay
        (lambda: (b"not json", signed(b"not json", secret=WRONG_SECRET)), "no signature"),  # 401, not 400
        (lambda: (order(7), {}), "missing header"),
    ],
)
def test_an_unauthentic_request_is_401_and_writes_nothing(engine, sessions, shop, request_of, complaint):
    body, headers = request_of()
    receipt = receive(
        shop.inbox, sessions, body=body, headers=headers, secret=SECRET, event_type="order.paid"
    )
    assert receipt.status_code == 401
    assert receipt.processed is None
    assert receipt.reason.startswith("webhook verification failed: ") and complaint in receipt.reason
    assert stored(engine) == (0, 0, 0)
    assert shop.seen == []


def test_a_receiver_that_knows_several_secrets_accepts_any_of_them(engine, sessions, shop):
    orders = WebhookReceiver(shop.inbox, sessions, secret=[SECRET, OLD_SECRET], event_type="order.paid")
    assert orders.receive(order(1), signed(order(1), "msg_1", secret=OLD_SECRET)).status_code == 200
    assert orders.receive(order(2), signed(order(2), "msg_2", secret=SECRET)).status_code == 200
    assert orders.receive(order(3), signed(order(3), "msg_3", secret=WRONG_SECRET)).status_code == 401
    assert stored(engine) == (2, 0, 2)


@pytest.mark.parametrize(
    "body, msg_id, complaint",
    [
        (b"{not json", "msg_1", "the body is not JSON: JSONDecodeError"),
        (b"\xff\xfe\x00", "msg_1", "the body is not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "msg_1", "the body is not JSON"),  # deeper than Python recurses
        (json.dumps({"order_id": 7}).encode(), "msg_1", "no event type"),
        (json.dumps({"type": 7, "data": {}}).encode(), "msg_1", "no event type"),
        (json.dumps({"type": "", "data": {}}).encode(), "msg_1", "no event type"),
        (json.dumps([1, 2]).encode(), "msg_1", "no event type"),
        (json.dumps({"type": "order.paid\u0000"}).encode(), "msg_1", "cannot be stored: event_type"),
        (json.dumps({"type": "order.paid"}).encode(), "m" * 256, "cannot be stored: a message id"),
    ],
)
def test_a_body_that_can_never_be_taken_is_400_and_writes_nothing(engine, sessions, body, msg_id, complaint):
    inbox = Inbox("any_type")
    inbox.handler("#", name="anything")(lambda session, message: None)
    receipt = receive(inbox, sessions, body=body, headers=signed(body, msg_id), secret=SECRET)
    assert (receipt.status_code, receipt.processed) == (400, None)
    assert complaint in receipt.reason
    # The sender records the refusal with its message: nothing here, so a corrected copy is taken as new.
    assert stored(engine) == (0, 0, 0)


def test_a_failing_handler_is_500_stores_nothing_and_the_repeat_is_handled(engine, sessions, shop, caplog):
    shop.failures.append(RuntimeError("card 4242 declined by the ledger"))
    orders = WebhookReceiver(shop.inbox, sessions, secret=SECRET, event_type="order.paid")
    body = order(7)

    with caplog.at_level(logging.WARNING, logger="outbox.integrations.webhook"):
        failed = orders.receive(body, signed(body))
    assert (failed.status_code, failed.processed) == (500, None)
    assert failed.reason == "handler 'record_payment' failed (RuntimeError); nothing stored, send it again"
    assert isinstance(failed.error, outbox.HandlerFailed)
    assert stored(engine) == (0, 0, 0)  # the payment rolled back with the marker
    (line,) = caplog.records
    assert line.action == "webhook_handler_failed" and line.message_id == "msg_1"  # type: ignore[attr-defined]
    assert "card 4242 declined" in line.getMessage()  # the receiver's log says why; the sender is not told

    retried = orders.receive(body, signed(body))
    assert (retried.status_code, retried.reason) == (200, "handled")
    assert stored(engine) == (1, 0, 1)


def test_final_outcomes_answer_200_so_the_sender_stops(engine, sessions, shop):
    shop.failures.append(PermanentError("order 7 belongs to another shop"))
    orders = WebhookReceiver(shop.inbox, sessions, secret=SECRET, event_type="order.paid")
    refused = orders.receive(order(7), signed(order(7), "msg_1", cookie="session=abc"))
    assert refused.status_code == 200 and refused.processed is not None
    assert refused.processed.outcome == "dead" and refused.processed.dead_letter_id is not None
    assert refused.reason == (
        "recorded as a dead letter (outbox.PermanentError) in the receiver's inbox; do not send it again"
    )
    assert orders.receive(order(7), signed(order(7), "msg_1")).reason.startswith("duplicate")
    with engine.connect() as conn:
        letter = conn.execute(select(dead).where(dead.c.message_id == "msg_1")).one()
    assert (letter.source, letter.payload, letter.error_type) == (
        "webhook",
        {"order_id": 7},
        "outbox.PermanentError",
    )
    assert sorted(letter.headers) == [
        "content-type",
        "webhook-id",
        "webhook-timestamp",
    ]  # no signature, no cookie

    unknown = WebhookReceiver(shop.inbox, sessions, secret=SECRET, event_type="order.shipped")
    nobody = unknown.receive(order(8), signed(order(8), "msg_2"))
    assert nobody.status_code == 200 and "outbox.NoInboxHandler" in nobody.reason
    skipping = Inbox("partner_payments_skip", unhandled="skip")
    skipped = receive(
        skipping, sessions, body=order(9), headers=signed(order(9), "msg_3"), secret=SECRET, event_type="x.y"
    )
    assert (skipped.status_code, skipped.processed and skipped.processed.outcome) == (200, "unhandled")
    assert stored(engine) == (3, 2, 0)  # two dead letters with their markers, one skipped marker


def test_a_database_error_is_503_and_the_request_is_taken_once_the_database_is_back(empty_url, caplog):
    engine = create_engine(empty_url)  # a database without the outbox's tables
    shop = Payments()
    orders = WebhookReceiver(shop.inbox, sessionmaker(engine), secret=SECRET, event_type="order.paid")
    body = order(7)
    try:
        with caplog.at_level(logging.ERROR, logger="outbox.integrations.webhook"):
            receipt = orders.receive(body, signed(body))
        assert (receipt.status_code, receipt.processed) == (503, None)
        assert receipt.reason.startswith("database error (") and receipt.reason.endswith("send it again")
        (line,) = caplog.records
        assert line.action == "webhook_database_error"  # type: ignore[attr-defined]
        assert "INSERT" not in line.getMessage()  # the driver's message, not the statement

        outbox.upgrade(engine)
        payments.create(engine)
        assert orders.receive(body, signed(body)).reason == "handled"
        assert stored(engine) == (1, 0, 1)
    finally:
        engine.dispose()


NOBODY = "outbox@127.0.0.1:9/none"  # the discard port: nothing listens on it here


def test_a_database_nobody_answers_is_503():
    engine = create_engine(f"postgresql+psycopg://{NOBODY}?connect_timeout=5")
    orders = WebhookReceiver(Payments().inbox, sessionmaker(engine), secret=SECRET, event_type="order.paid")
    receipt = orders.receive(order(7), signed(order(7)))
    assert receipt.status_code == 503 and "OperationalError" in receipt.reason
    engine.dispose()


@pytest.mark.parametrize("driver", ["postgresql+asyncpg", "postgresql+psycopg_async"])
def test_an_async_database_nobody_answers_is_503(driver):
    async def scenario() -> WebhookReceipt:
        engine = create_async_engine(f"{driver}://{NOBODY}")
        orders = WebhookReceiver(
            Payments().inbox, async_sessionmaker(engine), secret=SECRET, event_type="x.y"
        )
        try:
            return await orders.areceive(order(7), signed(order(7)))
        finally:
            await engine.dispose()

    receipt = asyncio.run(scenario())
    assert receipt.status_code == 503, receipt  # asyncpg's own ConnectionRefusedError, psycopg's wrapped one


def test_concurrent_deliveries_of_one_webhook_take_effect_once(pg_engine):
    payments.create(pg_engine)
    shop = Payments()
    orders = WebhookReceiver(shop.inbox, sessionmaker(pg_engine), secret=SECRET, event_type="order.paid")
    body = order(7)
    start = threading.Barrier(4)
    receipts: list[WebhookReceipt] = []

    def deliver() -> None:
        headers = signed(body)
        start.wait()
        receipts.append(orders.receive(body, headers))

    threads = [threading.Thread(target=deliver) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.reason.split(":")[0] for r in receipts) == ["duplicate"] * 3 + ["handled"]
    assert {r.status_code for r in receipts} == {200}
    assert stored(pg_engine) == (1, 0, 1)


@pytest.mark.parametrize(
    "options, complaint",
    [
        ({"secret": None}, "needs secret='whsec_...'"),
        ({"secret": "whsec_c2VjcmV0"}, "the webhook secret decodes to 6 bytes"),
        ({"secret": "sk_live_notawebhooksecret"}, "the webhook secret must start with 'whsec_'"),
        ({"secret": [SECRET, "whsec_!!"]}, "webhook secret #2 is not valid base64"),
        ({"secret": []}, "at least one"),
        ({"tolerance": 0}, "tolerance must be > 0"),
        ({"tolerance": float("nan")}, "tolerance must be a number"),
        ({"tolerance": "300"}, "tolerance must be a number"),
        ({"event_type": ""}, "event_type must be a non-empty string"),
        ({"source": "x" * 300}, "source must be at most 255"),
        ({"inbox": "partner_payments"}, "takes an outbox.Inbox first, got str"),
        ({"sessions": "sqlite://"}, "takes a sessionmaker or an Engine"),
    ],
)
def test_bad_settings_fail_the_first_call_in_one_line_whatever_the_request(options, complaint):
    settings: dict[str, Any] = {
        "inbox": Inbox("partner_payments"),
        "sessions": sessionmaker(),
        "secret": SECRET,
        **options,
    }
    inbox, sessions = settings.pop("inbox"), settings.pop("sessions")
    unsigned = {"webhook-id": "msg_1"}  # a request that would be refused; the settings are checked first
    for attempt in (
        lambda: receive(inbox, sessions, body=b"{}", headers=unsigned, **settings),
        lambda: WebhookReceiver(inbox, sessions, **settings),
    ):
        with pytest.raises(ConfigurationError) as raised:
            attempt()
        text = str(raised.value)
        assert complaint in text and "\n" not in text
        assert "c2VjcmV0" not in text and "sk_live" not in text and "!!" not in text


def test_sync_and_async_calls_refuse_the_other_kind_of_sessions(engine):
    async_engine = create_async_engine("sqlite+aiosqlite://")
    inbox = Inbox("partner_payments")
    with pytest.raises(ConfigurationError, match=r"needs async sessions, and these are sync: use receive"):
        asyncio.run(areceive(inbox, sessionmaker(engine), body=b"{}", headers={}, secret=SECRET))  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match=r"needs sync sessions, and these are async: use await areceive"
    ):
        receive(inbox, async_sessionmaker(async_engine), body=b"{}", headers={}, secret=SECRET)  # type: ignore[arg-type]
    receiver = WebhookReceiver(inbox, async_engine, secret=SECRET)
    with pytest.raises(ConfigurationError, match=r"use await receiver\.areceive"):
        receiver.receive(b"{}", {})


def test_the_secret_appears_in_no_reason_and_no_log_line(engine, sessions, shop, caplog):
    shop.failures.append(RuntimeError("ledger down"))
    orders = WebhookReceiver(shop.inbox, sessions, secret=[SECRET, OLD_SECRET], event_type="order.paid")
    any_type = WebhookReceiver(shop.inbox, sessions, secret=SECRET)
    with caplog.at_level(logging.DEBUG):
        receipts = [
            orders.receive(order(1), signed(order(1), "msg_1")),  # 500
            orders.receive(order(1), signed(order(1), "msg_1")),  # handled
            orders.receive(order(1), signed(order(1), "msg_1")),  # duplicate
            orders.receive(order(2), signed(order(2), "msg_2", secret=WRONG_SECRET)),  # 401
            any_type.receive(b"{}", signed(b"{}", "msg_3")),  # 400
            any_type.receive(b"{", signed(b"{", "msg_4")),  # 400
        ]
    assert [r.status_code for r in receipts] == [500, 200, 200, 401, 400, 400]
    said = [r.reason for r in receipts] + [r.getMessage() for r in caplog.records] + [repr(orders)]
    for secret in (SECRET, OLD_SECRET):
        key = secret.removeprefix("whsec_")
        assert not [line for line in said if key in line or key[:12] in line]


# -- async --------------------------------------------------------------------------------------------


@pytest.fixture
def async_url(database_url: str) -> str:
    url = make_url(database_url)
    sync = create_engine(url)
    payments.create(sync)
    sync.dispose()
    return url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()]).render_as_string(hide_password=False)


def test_areceive_takes_a_webhook_once_with_async_sessions(async_url, database_url):
    inbox = Inbox("partner_payments")
    failures = [RuntimeError("ledger down")]

    @inbox.handler("order.paid", name="record_payment")
    async def record_payment(session: AsyncSession, message: InboxMessage) -> None:
        await session.execute(
            insert(payments).values(message_id=message.id, order_id=message.payload["order_id"])
        )
        if failures:
            raise failures.pop(0)

    async def scenario() -> list[WebhookReceipt]:
        engine = create_async_engine(async_url)
        sessions = async_sessionmaker(engine)
        orders = WebhookReceiver(inbox, sessions, secret=SECRET, event_type="order.paid")
        body = order(7)
        try:
            return [
                await orders.areceive(body, signed(body)),
                await areceive(
                    inbox, sessions, body=body, headers=signed(body), secret=SECRET, event_type="order.paid"
                ),
                await orders.areceive(body, signed(body)),
                await orders.areceive(body, signed(body, secret=WRONG_SECRET)),
                await orders.areceive(b"[", signed(b"[")),
            ]
        finally:
            await engine.dispose()

    receipts = asyncio.run(scenario())
    assert [(r.status_code, r.reason.split(" ")[0]) for r in receipts] == [
        (500, "handler"),
        (200, "handled"),
        (200, "duplicate:"),
        (401, "webhook"),
        (400, "the"),
    ]
    sync = create_engine(database_url)
    try:
        assert stored(sync) == (1, 0, 1)
    finally:
        sync.dispose()
