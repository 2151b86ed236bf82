"""EmailHandler against a real aiosmtpd server on 127.0.0.1, through the real relay and directly."""

from __future__ import annotations

import base64
import email
import email.policy
import logging
import ssl
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from sqlalchemy import create_engine, func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import sessionmaker
from stamped import as_reported
from tlscert import self_signed
from unchecked import store_unchecked

import outbox
from outbox import (
    Backoff,
    ConfigurationError,
    Message,
    Outbox,
    PayloadError,
    PermanentError,
    RetryLater,
    emit,
)
from outbox.integrations.email import EmailHandler, RateLimiter, SentLog, outbox_email_sent
from outbox.relay import Relay
from outbox.testing import messages

m, a = outbox.outbox_message, outbox.outbox_attempt
PASSWORD = "s3cr3t-smtp-pass-do-not-log"
SENDER = "Shop <shop@example.com>"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Received:
    at: float  # the server's clock (time.monotonic in this process) when DATA completed
    rcpt_tos: list[str]
    mail: email.message.EmailMessage


@dataclass
class Script:
    """A scripted SMTP server: replies are consumed in order, then 250 for ever."""

    data_replies: list[str] = field(default_factory=list)
    rcpt_replies: dict[str, list[str]] = field(default_factory=dict)
    drop_next_data: bool = False
    accept_then_drop_next_data: bool = False
    hang_next_data: float = 0.0
    received: list[Received] = field(default_factory=list)
    logins: list[str] = field(default_factory=list)

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str, options: Any) -> str:  # noqa: N802
        scripted = self.rcpt_replies.get(address)
        if scripted:
            return scripted.pop(0)
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        if self.drop_next_data:
            # The whole mail arrived, the connection dies before the reply: the client cannot
            # know whether it was accepted (here it was not; the server keeps nothing).
            self.drop_next_data = False
            server.transport.close()
            return "421 closing"
        if self.accept_then_drop_next_data:
            # The server keeps the mail (queued for delivery), then the connection dies before
            # its 250 reaches the client: the one case the sent-log cannot see.
            self.accept_then_drop_next_data = False
            parsed = email.message_from_bytes(envelope.content, policy=email.policy.default)
            self.received.append(Received(time.monotonic(), list(envelope.rcpt_tos), parsed))  # type: ignore[arg-type]
            server.transport.abort()
            return "250 2.0.0 queued as Q0 (never seen by the client)"
        if self.hang_next_data:
            import asyncio

            delay, self.hang_next_data = self.hang_next_data, 0.0
            await asyncio.sleep(delay)
            return "451 too slow"
        reply = self.data_replies.pop(0) if self.data_replies else "250 2.0.0 queued as Q1"
        if reply.startswith("250"):
            parsed = email.message_from_bytes(envelope.content, policy=email.policy.default)
            self.received.append(Received(time.monotonic(), list(envelope.rcpt_tos), parsed))  # type: ignore[arg-type]
        return reply

    def authenticate(self, server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        assert isinstance(data, LoginPassword)
        self.logins.append(data.login.decode())
        return AuthResult(success=data.password.decode() == PASSWORD, handled=False)


@dataclass
class Smtp:
    script: Script
    port: int


def start_server(request: pytest.FixtureRequest, **options: Any) -> Smtp:
    script = Script()
    options.setdefault("auth_require_tls", False)
    controller = Controller(
        script, hostname="127.0.0.1", port=free_port(), authenticator=script.authenticate, **options
    )
    controller.start()
    request.addfinalizer(controller.stop)
    return Smtp(script, int(controller.port))


@pytest.fixture
def smtp(request: pytest.FixtureRequest) -> Smtp:
    return start_server(request)


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command."""
    return self_signed(tmp_path_factory.mktemp("tls"), "127.0.0.1", "IP:127.0.0.1")


def tls_contexts(certificate: tuple[Path, Path]) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    cert, key = certificate
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


def setup(engine: Engine, port: int, **options: Any) -> tuple[Outbox, sessionmaker[Any]]:
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    handler = EmailHandler("127.0.0.1", port, sender=SENDER, sent_log=SentLog(engine), **options)
    ob.route("mail", handler, name="mailer", max_attempts=4, timeout=10)
    factory = sessionmaker(engine)
    ob.install(factory)
    return ob, factory


def send(ob: Outbox, factory: sessionmaker[Any], *payloads: dict[str, Any], key: str | None = None) -> None:
    with factory() as s, s.begin():
        for payload in payloads:
            emit(s, "mail", payload, key=key)


def drain_all(ob: Outbox, engine: Engine, **relay_options: Any) -> None:
    for _ in range(50):
        Relay(ob, engine, **relay_options).run_until_idle()
        with engine.connect() as conn:
            if not conn.execute(select(func.count()).where(m.c.status.in_(("pending", "running")))).scalar():
                return
        time.sleep(0.01)
    raise AssertionError("the outbox did not drain")


def outcomes(engine: Engine) -> list[tuple[str, Any]]:
    with engine.connect() as conn:
        return [(r.outcome, r.detail) for r in conn.execute(select(a).order_by(a.c.id))]


def a_message(**fields: Any) -> Message:
    values: dict[str, Any] = {
        "id": 7,
        "event_id": uuid.uuid4(),
        "event_type": "mail",
        "handler": "mailer",
        "payload": {"to": "a@example.com", "subject": "S", "text": "t"},
        "key": "k1",
    }
    return Message(**{**values, **fields})


def parts_of(mail: email.message.EmailMessage) -> dict[str, str]:
    return {p.get_content_type(): p.get_content().strip() for p in mail.walk() if not p.is_multipart()}


# -- content and headers -------------------------------------------------------------------------


def test_delivers_a_multipart_mail_with_its_headers_and_records_it(engine, smtp):
    ob, factory = setup(engine, smtp.port)
    payload = {
        "to": ["Ada Lovelace <ada@example.com>", "bob@example.com"],
        "subject": "Hi",
        "text": "plain",
        "html": "<b>x</b>",
    }
    send(ob, factory, payload, key="welcome:ada")
    drain_all(ob, engine)

    [got] = smtp.script.received
    mail = got.mail
    assert got.rcpt_tos == ["ada@example.com", "bob@example.com"]
    assert mail["From"] == SENDER and mail["To"] == "Ada Lovelace <ada@example.com>, bob@example.com"
    assert mail["Subject"] == "Hi" and mail["Date"] is not None
    assert mail.get_content_type() == "multipart/alternative"
    assert parts_of(mail) == {"text/plain": "plain", "text/html": "<b>x</b>"}
    handler = ob.routes[0].handler
    with engine.connect() as conn:
        row = conn.execute(select(m.c.id, m.c.event_id, m.c.idempotency_key)).one()
        sent = conn.execute(select(outbox_email_sent)).one()
    expected = handler.message_id(a_message(id=row.id, event_id=row.event_id, key="welcome:ada"))
    assert mail["Message-ID"] == expected and expected.endswith("@example.com>")
    assert (sent.message_id, sent.handler, sent.outbox_message_id, sent.attempt) == (
        expected,
        "mailer",
        row.id,
        1,
    )
    assert sent.smtp_response.startswith("250") and sent.accepted_at.tzinfo is not None
    [(outcome, detail)] = outcomes(engine)
    assert outcome == "delivered"
    assert detail["smtp_code"] == 250 and detail["message_id"] == expected and detail["recipients"] == 2


def test_text_only_and_html_only_bodies():
    handler = EmailHandler(sender="shop@example.com")
    text = handler.build(a_message(payload={"to": "a@example.com", "subject": "S", "text": "Grüße"}))
    assert text.get_content_type() == "text/plain" and text.get_content().strip() == "Grüße"
    html = handler.build(a_message(payload={"to": "a@example.com", "subject": "S", "html": "<p>x</p>"}))
    assert html.get_content_type() == "text/html"
    with pytest.raises(PermanentError, match="text"):
        handler.build(a_message(payload={"to": "a@example.com", "subject": "S"}))
    with pytest.raises(PermanentError, match="subject"):
        handler.build(a_message(payload={"to": "a@example.com", "text": "t"}))


def test_message_id_derives_from_the_key_or_the_event_and_the_route():
    handler = EmailHandler(sender="Shop <shop@Example.com>")
    event = uuid.uuid4()
    keyed = handler.message_id(a_message(key="signup:1", event_id=event, attempt=1))
    assert keyed == handler.message_id(a_message(key="signup:1", id=99, event_id=uuid.uuid4(), attempt=3))
    assert keyed.startswith("<") and keyed.endswith("@example.com>")
    assert keyed != handler.message_id(a_message(key="signup:1", handler="other_route"))
    assert keyed != handler.message_id(a_message(key="signup:2"))
    unkeyed = handler.message_id(a_message(key=None, event_id=event))
    assert unkeyed == handler.message_id(a_message(key=None, event_id=event, id=8, attempt=2))
    assert unkeyed != handler.message_id(a_message(key=None, event_id=uuid.uuid4()))


def test_international_addresses(request):
    handler = EmailHandler(sender="Shop <shop@example.com>")
    mail = handler.build(a_message(payload={"to": "Jürgen <j@bücher.example>", "subject": "Ä", "text": "t"}))
    assert mail["To"].addresses[0].domain == "xn--bcher-kva.example"  # IDNA, no SMTPUTF8 needed
    plain = start_server(request, enable_SMTPUTF8=False)  # aiosmtpd's Controller enables it by default
    local = a_message(payload={"to": "jürgen@example.com", "subject": "S", "text": "t"})
    handler = EmailHandler("127.0.0.1", plain.port, sender="shop@example.com")
    with pytest.raises(PermanentError, match="SMTPUTF8"):
        handler(local)
    utf8 = start_server(request, enable_SMTPUTF8=True)
    EmailHandler("127.0.0.1", utf8.port, sender="shop@example.com")(local)
    assert utf8.script.received[0].rcpt_tos == ["jürgen@example.com"]


# -- error classes ---------------------------------------------------------------------------------


def test_451_is_retried_and_sends_one_mail(engine, smtp):
    smtp.script.data_replies = ["451 4.3.0 try again later"]
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert len(smtp.script.received) == 1
    got = outcomes(engine)
    assert [o for o, _ in got] == ["retry", "delivered"]
    assert got[0][1]["smtp_code"] == 451 and "try again later" in got[0][1]["smtp_message"]


def test_550_is_dead_at_once_with_the_code_recorded(engine, smtp):
    smtp.script.data_replies = ["550 5.1.1 no such user"]
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "nobody@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert smtp.script.received == []
    [(outcome, detail)] = outcomes(engine)
    assert (outcome, detail["smtp_code"], detail["smtp_stage"]) == ("dead", 550, "data")
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.attempts)).one() == ("dead", 1)


def test_one_refused_recipient_means_no_mail_to_anyone(engine, smtp):
    smtp.script.rcpt_replies = {"gone@example.com": ["550 5.1.1 no such user"]}
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": ["a@example.com", "gone@example.com"], "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert smtp.script.received == []
    [(outcome, detail)] = outcomes(engine)
    assert outcome == "dead" and detail["smtp_code"] == 550
    assert detail["refused"] == {"gone@example.com": 550}


def test_a_greylisted_recipient_is_retried(engine, smtp):
    smtp.script.rcpt_replies = {"a@example.com": ["450 4.2.0 greylisted"]}
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert len(smtp.script.received) == 1
    assert [(o, (d or {}).get("smtp_code")) for o, d in outcomes(engine)] == [
        ("retry", 450),
        ("delivered", 250),
    ]


def test_connection_dropped_mid_data_is_retried_and_still_one_mail(engine, smtp):
    smtp.script.drop_next_data = True
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert len(smtp.script.received) == 1
    got = outcomes(engine)
    assert [o for o, _ in got] == ["retry", "delivered"]
    assert got[0][1]["smtp_stage"] == "data"
    # Nothing was recorded for the dropped attempt; the retry's acceptance was.
    with engine.connect() as conn:
        [sent] = conn.execute(select(outbox_email_sent)).all()
    assert sent.attempt == 2 and sent.message_id == smtp.script.received[0].mail["Message-ID"]


def test_a_mail_accepted_whose_reply_was_lost_goes_twice_with_one_message_id(engine, smtp):
    """The documented residual window: no 250 was seen, so the sent-log has nothing to refuse."""
    smtp.script.accept_then_drop_next_data = True
    ob, factory = setup(engine, smtp.port)  # with the sent-log
    send(ob, factory, {"to": "a@example.com", "subject": "Reset", "text": "t"}, key="reset:ada")
    drain_all(ob, engine)

    first, second = smtp.script.received  # the server holds two copies of the one message
    handler = ob.routes[0].handler
    with engine.connect() as conn:
        row = conn.execute(select(m)).one()
        [sent] = conn.execute(select(outbox_email_sent)).all()
    message_id = handler.message_id(a_message(id=row.id, event_id=row.event_id, key=row.idempotency_key))
    assert first.mail["Message-ID"] == second.mail["Message-ID"] == message_id, "receivers can deduplicate"
    got = outcomes(engine)
    assert [o for o, _ in got] == ["retry", "delivered"]
    assert got[0][1]["smtp_stage"] == "data" and "smtp_code" not in got[0][1]
    # The sent-log records the acceptance the client saw: the second attempt's.
    assert (sent.message_id, sent.outbox_message_id, sent.attempt) == (message_id, row.id, 2)
    assert row.status == "delivered" and row.attempts == 2
    # From that record on, the guarantee holds: a further attempt sends nothing.
    again = handler(a_message(id=row.id, event_id=row.event_id, key=row.idempotency_key, attempt=3))
    assert again["skipped"] == "already accepted by the server" and again["accepted_in_attempt"] == 2
    assert len(smtp.script.received) == 2


def test_refused_connections_and_timeouts_are_transient(smtp):
    nobody = EmailHandler("127.0.0.1", free_port(), sender="shop@example.com", timeout=2)
    with pytest.raises(RetryLater) as refused:
        nobody(a_message())
    assert refused.value.detail is not None and refused.value.detail["smtp_stage"] == "connect"

    smtp.script.hang_next_data = 1.0
    slow = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", timeout=0.2)
    with pytest.raises(RetryLater) as timed_out:
        slow(a_message())
    assert timed_out.value.detail == {
        "smtp_stage": "data",
        "error": "timeout",
        "smtp_message": timed_out.value.detail["smtp_message"],
    }


# -- exactly-once effect ----------------------------------------------------------------------------


def test_a_message_the_server_already_accepted_is_not_sent_again(engine, smtp):
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", sent_log=engine)
    msg = a_message()
    first = handler(msg)
    again = handler(msg)  # a retry after a crash between acceptance and the relay's record
    assert len(smtp.script.received) == 1
    assert again["skipped"] and again["message_id"] == first["message_id"]
    assert again["accepted_in_attempt"] == 1


def test_the_relay_skips_a_mail_accepted_before_the_message_was_recorded_as_delivered(engine, smtp):
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"}, key="order:1")
    with engine.connect() as conn:
        row = conn.execute(select(m)).one()
    # The first attempt got as far as the server's 250 and the sent-log, then the relay died.
    ob.routes[0].handler(a_message(id=row.id, event_id=row.event_id, key=row.idempotency_key))
    drain_all(ob, engine)
    assert len(smtp.script.received) == 1
    [(outcome, detail)] = outcomes(engine)
    assert outcome == "delivered" and detail["skipped"] == "already accepted by the server"


@pytest.mark.parametrize("sent_log", [True, False])
def test_by_default_the_sent_log_lives_in_the_relays_database(engine, smtp, sent_log):
    """No engine in the handler's configuration: a relay binds the sent-log to its own database."""
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    options = {} if sent_log else {"sent_log": False}
    handler = EmailHandler("127.0.0.1", smtp.port, sender=SENDER, **options)
    assert handler.sent_log is None  # nothing to bind to until a relay starts
    ob.route("mail", handler, name="mailer", max_attempts=4, timeout=10)
    factory = sessionmaker(engine)
    ob.install(factory)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"}, key="order:1")
    drain_all(ob, engine)
    assert len(smtp.script.received) == 1
    # The server accepted it, then the outcome was lost (a crash before it was recorded):
    with engine.begin() as conn:
        conn.execute(update(m).values(status="pending", attempts=0, delivered_at=None))
    drain_all(ob, engine)
    if sent_log:
        assert len(smtp.script.received) == 1, "the retry found the mail in the sent-log"
        assert outcomes(engine)[-1][1]["skipped"] == "already accepted by the server"
    else:  # the control: without a sent-log the same retry sends it again
        assert len(smtp.script.received) == 2


def test_a_requeued_copy_is_the_same_mail_to_the_sent_log(engine, smtp):
    from outbox.ops import MessageFilter, requeue

    smtp.script.data_replies = ["550 5.7.1 relaying denied"]  # fixed on the server side, later
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"}, key="invoice:9")
    drain_all(ob, engine)
    [(old_id, new_id)] = requeue(engine, MessageFilter(status="dead"), reason="relay fixed", actor="test")
    drain_all(ob, engine)
    [got] = smtp.script.received
    handler = ob.routes[0].handler
    with engine.connect() as conn:
        old, new = (conn.execute(select(m).where(m.c.id == i)).one() for i in (old_id, new_id))
    assert new.idempotency_key != old.idempotency_key and new.status == "delivered"
    assert got.mail["Message-ID"] == handler.message_id(a_message(key=old.idempotency_key))
    # A second requeue-and-deliver of the same mail would now find it in the sent-log.
    assert handler(a_message(id=new_id, key=new.idempotency_key + "~requeue:99"))["skipped"]
    assert len(smtp.script.received) == 1


def test_a_resent_mail_the_sent_log_remembers_is_not_sent_again_and_a_keyless_one_is(engine, smtp):
    """What docs/email.md says of ``outbox resend``: a resent copy is the same mail, Message-ID and all."""
    from outbox.ops import MessageFilter, resend

    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"}, key="receipt:9")
    send(ob, factory, {"to": "b@example.com", "subject": "S", "text": "t"})  # no key: the event id counts
    drain_all(ob, engine)
    first, keyless = smtp.script.received
    pairs = resend(engine, MessageFilter(status="delivered"), reason="the customer lost it", actor="test")
    drain_all(ob, engine)
    assert len(pairs) == 2 and len(smtp.script.received) == 2, "neither copy sent: same Message-ID"
    rows = {r.id: r for r in messages(engine)}
    for old, new in pairs:
        assert rows[new].status == "delivered" and rows[new].event_id == rows[old].event_id
    skipped = [d for outcome, d in outcomes(engine)[-2:] if outcome == "delivered"]
    assert [d["skipped"] for d in skipped] == ["already accepted by the server"] * 2
    assert {d["message_id"] for d in skipped} == {first.mail["Message-ID"], keyless.mail["Message-ID"]}


def sent_then_dead(engine: Engine, message_id: int) -> None:
    """The server accepted the mail and the sent-log recorded it, yet the message ended dead.

    What a route timeout that fires first does on a message's last attempt: the worker thread's
    conversation still ends in a sent mail (docs/email.md, Configuration).
    """
    with engine.begin() as conn:
        conn.execute(update(m).where(m.c.id == message_id).values(status="dead", delivered_at=None))


@pytest.mark.parametrize("length", [200, 246, 255])
def test_a_requeued_copy_is_the_same_mail_at_any_key_length_and_a_copy_of_a_copy_too(engine, smtp, length):
    from outbox.ops import MessageFilter, requeue

    key = "ticket:" + "t" * (length - 11) + "ключ"  # the limit counts characters, not bytes
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"}, key=key)
    drain_all(ob, engine)
    [sent] = smtp.script.received
    chain = [messages(engine)[0].id]
    for _ in range(2):  # the original, then its copy: each sent (or skipped), then dead, then requeued
        sent_then_dead(engine, chain[-1])
        [(old, new)] = requeue(engine, MessageFilter(ids=(chain[-1],)), reason="looked lost", actor="test")
        assert old == chain[-1]
        chain.append(new)
        drain_all(ob, engine)
    assert [r.mail["Message-ID"] for r in smtp.script.received] == [sent.mail["Message-ID"]], "sent once"
    rows = {r.id: r for r in messages(engine)}
    original, copy, copy_of_copy = (rows[i] for i in chain)
    assert original.idempotency_key == key and len(copy_of_copy.idempotency_key) <= 255
    assert (copy.requeued_from, copy_of_copy.requeued_from) == (original.id, copy.id)
    assert copy_of_copy.status == "delivered"
    handler = ob.routes[0].handler
    with engine.connect() as conn:
        history = conn.execute(select(a.c.message_id, a.c.detail).where(a.c.outcome == "delivered")).all()
        sent_log = conn.execute(select(outbox_email_sent.c.message_id, outbox_email_sent.c.outbox_message_id))
        [recorded] = sent_log.all()
    assert recorded == (sent.mail["Message-ID"], original.id)
    assert [(i, d.get("skipped"), d["message_id"]) for i, d in sorted(history, key=lambda h: h[0])] == [
        (original.id, None, sent.mail["Message-ID"]),
        (copy.id, "already accepted by the server", sent.mail["Message-ID"]),
        (copy_of_copy.id, "already accepted by the server", sent.mail["Message-ID"]),
    ]
    for row in (original, copy, copy_of_copy):
        assert handler.message_id(a_message(id=row.id, key=row.idempotency_key)) == sent.mail["Message-ID"]


def test_a_long_keyed_mail_accepted_under_an_earlier_releases_message_id_is_not_sent_again(engine, smtp):
    """Keys over 227 characters now count through their stand-in; the sent-log still knows the old id."""
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", sent_log=engine)
    key = "k" * 240
    earlier = f"<{uuid.uuid5(uuid.NAMESPACE_URL, f'outbox-email:mailer:key:{key}').hex}@example.com>"
    SentLog(engine).record(earlier, handler="mailer", outbox_message_id=7, attempt=1, response="250 ok")
    for message in (a_message(key=key), a_message(id=8, key=f"{key}~requeue:7")):
        skipped = handler(message)
        assert skipped["skipped"] == "already accepted by the server"
        assert skipped["accepted_message_id"] == earlier != skipped["message_id"]
    assert smtp.script.received == []
    assert handler(a_message(key="k" * 239 + "x"))["smtp_code"] == 250, "the control: another key is sent"


class BrokenSentLog(SentLog):
    def __init__(self, engine: Engine, *, reads: bool = True) -> None:
        super().__init__(engine)
        self.reads = reads

    def lookup(self, message_id: str) -> Any:
        if not self.reads:
            raise OperationalError("SELECT", {}, Exception("database is gone"))
        return super().lookup(message_id)

    def record(self, message_id: str, **kwargs: Any) -> None:
        raise OperationalError("INSERT", {}, Exception("database is gone"))


def test_an_accepted_mail_is_delivered_even_when_the_sent_log_cannot_record_it(engine, smtp, caplog):
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", sent_log=BrokenSentLog(engine))
    with caplog.at_level(logging.ERROR, logger="outbox.integrations.email"):
        detail = handler(a_message())
    assert detail["sent_log"] == "not recorded" and len(smtp.script.received) == 1
    assert [getattr(r, "action", None) for r in caplog.records] == ["email_sent_log_failed"]


def test_an_unreadable_sent_log_sends_nothing_and_retries(engine, smtp):
    handler = EmailHandler(
        "127.0.0.1", smtp.port, sender="shop@example.com", sent_log=BrokenSentLog(engine, reads=False)
    )
    with pytest.raises(RetryLater, match="sent-log"):
        handler(a_message())
    assert smtp.script.received == []


def test_sent_log_create_table_and_purge(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'plain.db'}")
    SentLog.create_table(engine)
    SentLog.create_table(engine)  # idempotent
    log = SentLog(engine)
    log.record("<a@example.com>", handler="mailer", outbox_message_id=1, attempt=1, response="250 ok")
    log.record("<a@example.com>", handler="mailer", outbox_message_id=1, attempt=2, response="250 ok")
    record = log.lookup("<a@example.com>")
    assert record is not None and record.attempt == 1 and log.was_sent("<a@example.com>")
    assert log.purge(record.accepted_at) == 0
    assert log.purge(record.accepted_at + __import__("datetime").timedelta(seconds=1)) == 1
    assert not log.was_sent("<a@example.com>")
    engine.dispose()


# -- header injection --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        {"to": "a@example.com", "subject": "Hi\r\nBcc: victim@example.com", "text": "t"},
        {"to": "a@example.com", "subject": "Hi\u2028Bcc: victim@example.com", "text": "t"},
        {"to": "a@example.com\nBcc: victim@example.com", "subject": "S", "text": "t"},
        {"to": ["Ada\r\nBcc: victim@example.com <a@example.com>"], "subject": "S", "text": "t"},
        {"to": "=?utf-8?q?Ada=0D=0ABcc:_v@example.com?= <a@example.com>", "subject": "S", "text": "t"},
        {"to": "not-an-address", "subject": "S", "text": "t"},
        {"to": "a@example.com, b@example.com", "subject": "S", "text": "t"},
        {"to": [], "subject": "S", "text": "t"},
    ],
)
def test_header_injection_and_bad_addresses_are_refused_at_emit_and_dead_not_sent(engine, smtp, payload):
    ob, factory = setup(engine, smtp.port)
    refused = r"^route 'mailer' refuses this 'mail' payload: payload '(to|subject)'"
    with pytest.raises(PayloadError, match=refused):
        send(ob, factory, payload)
    assert outcomes(engine) == [] and not messages(engine)
    store_unchecked(engine, "mail", payload, "mailer")  # stored before the check existed, say
    drain_all(ob, engine)
    assert smtp.script.received == []
    [(outcome, detail)] = outcomes(engine)
    assert outcome == "dead" and detail["reason"] in ("header_injection", "invalid_address")


#: The review's subject: a ticket title whose encoded word the email package would decode into a
#: forged Reply-To, a forged Content-Type and the attacker's HTML as the body.
FORGED_SUBJECT = (
    "=?utf-8?q?Your_ticket=0D=0AReply-To:_attacker@evil.example=0D=0AContent-Type:_text/html"
    "=0D=0A=0D=0A<a_href=3Dhttps://evil.example/login>Verify</a>?="
)
ENCODED_INJECTIONS = {
    "q-form": FORGED_SUBJECT,
    "b-form": "=?utf-8?b?"
    + base64.b64encode(b"Your ticket\r\nReply-To: attacker@evil.example\r\n\r\n<a>Verify</a>").decode()
    + "?=",
    "lf-only": "=?utf-8?q?Your_ticket=0AReply-To:_attacker@evil.example?=",
    "cr-only": "=?utf-8?q?Your_ticket=0DReply-To:_attacker@evil.example?=",
    "upper-case": "=?UTF-8?Q?Your_ticket=0D=0AReply-To:_attacker@evil.example?=",
    "lower-case-hex": "=?Utf-8?q?Your_ticket=0d=0aReply-To:_attacker@evil.example?=",
    "upper-b": "=?UTF-8?B?" + base64.b64encode(b"x\nReply-To: attacker@evil.example").decode() + "?=",
    "mid-text": "Your ticket =?iso-8859-1?q?=0A?=Reply-To: attacker@evil.example",
    "nested": "=?utf-8?q?=3D=3Futf-8=3Fq=3FYour_ticket=3D0AReply-To:_attacker@evil.example=3F=3D?=",
}


def refused_at_delivery(engine: Engine, smtp: Smtp, field: str) -> str:
    """Drain; the one message must be dead with nothing sent, its history naming ``field``, not the value."""
    with engine.connect() as conn:
        [row] = conn.execute(select(m.c.status, m.c.attempts)).all()
        [attempt] = conn.execute(select(a.c.outcome, a.c.error, a.c.detail)).all()
    assert smtp.script.received == [], "nothing reached the SMTP server"
    assert (row.status, row.attempts) == ("dead", 1), "permanent: no retry of a mail that cannot be sent"
    assert attempt.outcome == "dead"
    assert as_reported(attempt.detail) == {"field": field, "reason": "header_injection"}
    assert "header injection refused" in attempt.error and "evil.example" not in attempt.error
    return str(attempt.error)


@pytest.mark.parametrize("subject", ENCODED_INJECTIONS.values(), ids=ENCODED_INJECTIONS.keys())
def test_a_subject_whose_encoded_words_decode_to_a_line_break_is_refused_at_emit_and_dead(
    engine, smtp, subject
):
    ob, factory = setup(engine, smtp.port)
    payload = {"to": "a@example.com", "subject": subject, "text": "t"}
    refused = r"payload: payload 'subject' decodes .*\(header injection refused\)$"
    with pytest.raises(PayloadError, match=refused):
        send(ob, factory, payload)
    assert not messages(engine)
    store_unchecked(engine, "mail", payload, "mailer")  # stored by a release without the check, say
    drain_all(ob, engine)
    assert refused_at_delivery(engine, smtp, "subject").startswith("payload 'subject' ")


@pytest.mark.parametrize(
    "to",
    [
        "=?utf-8?b?" + base64.b64encode(b"Ada\r\nBcc: victim@evil.example").decode() + "?= <a@example.com>",
        "=?UTF-8?Q?Ada=0ABcc:_victim@evil.example?= <a@example.com>",
        '"=?utf-8?q?Ada=0D=0ABcc:_victim@evil.example?=" <a@example.com>',
        "=?utf-8?q?=3D=3Futf-8=3Fq=3FAda=3D0ABcc:_victim@evil.example=3F=3D?= <a@example.com>",
    ],
)
def test_a_display_name_whose_encoded_words_decode_to_a_line_break_is_refused(engine, smtp, to):
    ob, factory = setup(engine, smtp.port)
    payload = {"to": ["b@example.com", to], "subject": "S", "text": "t"}
    with pytest.raises(PayloadError, match=r"payload 'to': .*\(header injection refused\)$"):
        send(ob, factory, payload)
    store_unchecked(engine, "mail", payload, "mailer")
    drain_all(ob, engine)
    refused_at_delivery(engine, smtp, "to")


@pytest.mark.parametrize("title", [ENCODED_INJECTIONS[form] for form in ("q-form", "b-form", "lf-only")])
def test_a_rendered_subject_whose_encoded_words_decode_to_a_line_break_is_dead_at_delivery(
    engine, smtp, tmp_path, title
):
    (tmp_path / "ticket.subject.txt").write_text("{{ title }}")
    (tmp_path / "ticket.txt").write_text("Your ticket is open.")
    ob, factory = setup(engine, smtp.port, templates=tmp_path)
    # Rendering waits for delivery (a context_loader may complete the context), so emit stores it.
    send(ob, factory, {"to": "a@example.com", "template": "ticket", "context": {"title": title}})
    drain_all(ob, engine)
    error = refused_at_delivery(engine, smtp, "subject")
    assert error.startswith("the subject rendered from ticket.subject.txt ")


@pytest.mark.parametrize(
    ("subject", "received"),
    [
        ("=?utf-8?q?Caf=C3=A9?=", "Café"),
        ("=?UTF-8?B?" + base64.b64encode("Grüße".encode()).decode() + "?=", "Grüße"),
        ("Grüße aus Köln – Bestellung №5 ✓", "Grüße aus Köln – Bestellung №5 ✓"),
        ("Tabs\tare fine, and so is a lone =? or ?=", "Tabs\tare fine, and so is a lone =? or ?="),
    ],
)
def test_encoded_words_without_line_breaks_and_non_ascii_subjects_go_out(engine, smtp, subject, received):
    ob, factory = setup(engine, smtp.port)
    send(ob, factory, {"to": "=?utf-8?q?J=C3=BCrgen?= <j@example.com>", "subject": subject, "text": "t"})
    drain_all(ob, engine)
    [got] = smtp.script.received
    assert got.mail["Subject"] == received
    assert got.mail["To"].addresses[0].display_name == "Jürgen"
    assert [outcome for outcome, _ in outcomes(engine)] == ["delivered"]


def test_a_rendered_subject_with_a_line_break_is_refused(tmp_path):
    (tmp_path / "t.subject.txt").write_text("Hello {{ name }}")
    (tmp_path / "t.txt").write_text("body")
    handler = EmailHandler(sender="shop@example.com", templates=tmp_path)
    msg = a_message(
        payload={"to": "a@example.com", "template": "t", "context": {"name": "x\r\nBcc: v@x.com"}}
    )
    with pytest.raises(PermanentError, match="header injection"):
        handler.build(msg)


# -- authentication and secrets ------------------------------------------------------------------------


def test_authentication_failure_is_loud_and_never_leaks_the_password(engine, smtp, caplog):
    ob, factory = setup(engine, smtp.port, username="shop", password=PASSWORD + "-wrong")
    send(ob, factory, {"to": "a@example.com", "subject": "S", "text": "t"})
    with caplog.at_level(logging.DEBUG):
        drain_all(ob, engine)
    [(outcome, detail)] = outcomes(engine)
    assert outcome == "dead" and detail["smtp_code"] == 535 and detail["smtp_stage"] == "auth"
    loud = [r for r in caplog.records if getattr(r, "action", None) == "smtp_auth_failed"]
    assert loud and loud[0].levelno == logging.ERROR and loud[0].name == "outbox.integrations.email"
    handler = ob.routes[0].handler
    with engine.connect() as conn:
        stored = " ".join(str(tuple(r)) for t in (m, a) for r in conn.execute(select(t)))
    for form in handler.outbox_secrets():
        assert form not in stored and form not in caplog.text
    assert PASSWORD not in repr(handler) and PASSWORD not in repr(handler._smtp)
    assert smtp.script.logins and smtp.script.received == []


def test_outbox_secrets_cover_the_password_as_auth_sends_it():
    handler = EmailHandler(sender="shop@example.com", username="shop", password=PASSWORD)
    forms = handler.outbox_secrets()
    assert PASSWORD in forms
    assert base64.b64encode(PASSWORD.encode()).decode() in forms  # AUTH LOGIN
    assert base64.b64encode(f"\0shop\0{PASSWORD}".encode()).decode() in forms  # AUTH PLAIN
    assert EmailHandler(sender="shop@example.com").outbox_secrets() == []


def test_authenticated_delivery_over_starttls_and_implicit_tls(request, certificate):
    server_ctx, client_ctx = tls_contexts(certificate)
    starttls = start_server(request, tls_context=server_ctx, require_starttls=True, auth_require_tls=True)
    handler = EmailHandler(
        "127.0.0.1",
        starttls.port,
        sender="shop@example.com",
        username="shop",
        password=PASSWORD,
        starttls=True,
        ssl_context=client_ctx,
    )
    assert handler(a_message())["smtp_code"] == 250
    assert starttls.script.logins == ["shop"] and len(starttls.script.received) == 1

    implicit = start_server(request, ssl_context=server_ctx)
    handler = EmailHandler(
        "127.0.0.1",
        implicit.port,
        sender="shop@example.com",
        username="shop",
        password=PASSWORD,
        ssl=True,
        ssl_context=client_ctx,
    )
    assert handler(a_message())["smtp_code"] == 250 and len(implicit.script.received) == 1

    # An untrusted certificate is never accepted silently.
    untrusting = EmailHandler("127.0.0.1", implicit.port, sender="shop@example.com", ssl=True, timeout=2)
    with pytest.raises(RetryLater, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting(a_message())


def test_starttls_that_the_server_does_not_offer_is_refused(smtp):
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", starttls=True)
    with pytest.raises(PermanentError, match="STARTTLS"):
        handler(a_message())
    assert smtp.script.received == []


def test_a_password_sent_in_clear_to_a_remote_host_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="outbox.integrations.email"):
        for local in ("127.0.0.1", "::1", "localhost", "LOCALHOST", "localhost.", "mail.localhost"):
            EmailHandler(local, sender="a@example.com", username="u", password=PASSWORD)
        assert caplog.records == []
        EmailHandler("smtp.example.com", sender="a@example.com", username="u", password=PASSWORD)
    assert [getattr(r, "action", None) for r in caplog.records] == ["smtp_plaintext_auth"]
    assert PASSWORD not in caplog.text


# -- templates --------------------------------------------------------------------------------------------


def write_templates(folder: Path) -> Path:
    (folder / "welcome.subject.txt").write_text("Welcome, {{ name }}\n")
    (folder / "welcome.txt").write_text("Hello {{ name }}, your plan is {{ plan }}")
    (folder / "welcome.html").write_text("<p>Hello {{ name }}, your plan is {{ plan }}</p>")
    return folder


def test_templates_render_subject_text_and_escaped_html_with_loaded_context(engine, smtp, tmp_path):
    loaded: list[int] = []

    def load_plan(message: Message) -> dict[str, Any]:
        loaded.append(message.payload["context"]["user_id"])
        return {"plan": "<Pro>"}

    ob, factory = setup(engine, smtp.port, templates=write_templates(tmp_path), context_loader=load_plan)
    context = {"name": "<Ada>", "user_id": 5}
    send(ob, factory, {"to": "a@example.com", "template": "welcome", "context": context})
    drain_all(ob, engine)
    [got] = smtp.script.received
    assert got.mail["Subject"] == "Welcome, <Ada>" and loaded == [5]
    assert parts_of(got.mail) == {
        "text/plain": "Hello <Ada>, your plan is <Pro>",
        "text/html": "<p>Hello &lt;Ada&gt;, your plan is &lt;Pro&gt;</p>",
    }


def test_templates_from_a_jinja2_loader_and_template_errors_are_permanent(tmp_path):
    import jinja2

    loader = jinja2.DictLoader(
        {
            "ok.subject.txt": "Hi {{ name }}",
            "ok.html": "<i>{{ name }}</i>",
            "undefined.subject.txt": "Hi {{ nobody }}",
            "undefined.txt": "t",
            "escape.subject.txt": "x",
            "escape.txt": "{{ name.__class__.__mro__[1].__subclasses__() }}",
            "nobody.subject.txt": "x",
            "include.subject.txt": "x",
            "include.txt": "{% include 'missing.txt' %}",
        }
    )
    handler = EmailHandler(sender="shop@example.com", templates=loader)

    def build(template: str) -> email.message.EmailMessage:
        msg = a_message(payload={"to": "a@example.com", "template": template, "context": {"name": "&"}})
        return handler.build(msg)

    mail = build("ok")
    assert mail["Subject"] == "Hi &" and parts_of(mail) == {"text/html": "<i>&amp;</i>"}
    for template, reason in [
        ("undefined", "template_error"),
        ("escape", "template_error"),
        ("include", "template_error"),
        ("nobody", "template_not_found"),
        ("absent", "template_not_found"),
        ("../etc/passwd", "bad_template_name"),
    ]:
        with pytest.raises(PermanentError) as failed:
            build(template)
        assert failed.value.detail is not None and failed.value.detail["reason"] == reason, template
    no_templates = EmailHandler(sender="shop@example.com")
    with pytest.raises(PermanentError, match="no templates"):
        no_templates.build(a_message(payload={"to": "a@example.com", "template": "ok"}))


def test_templates_without_jinja2_fail_at_construction_with_the_install_hint(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ConfigurationError, match=r"pip install 'sqlalchemy-outbox\[email\]'"):
        EmailHandler(sender="a@example.com", templates=tmp_path)
    EmailHandler(sender="a@example.com")  # plain subject/text/html payloads need no Jinja2


# -- rate limit -------------------------------------------------------------------------------------------


def test_rate_limit_spaces_concurrent_deliveries_as_the_server_sees_them(engine, smtp):
    count, rate = 6, 5.0
    ob, factory = setup(engine, smtp.port, rate_limit=rate)
    send(ob, factory, *({"to": "a@example.com", "subject": f"S{n}", "text": "t"} for n in range(count)))
    drain_all(ob, engine, concurrency=count)
    stamps = sorted(r.at for r in smtp.script.received)
    assert len(stamps) == count
    assert_spaced(stamps, rate)


def assert_spaced(stamps: list[float], rate: float) -> None:
    """Slots are ``1 / rate`` apart, so the server sees (n - 1) / rate between first and last mail.

    Each mail still has its DATA to send after its slot, and on a busy machine the first can be
    slower than the last: the bound forgives one whole interval. The tests use 5 a second, so
    that interval (200 ms) is above such a lag (over 100 ms was seen once in CI at 10 a
    second). Without the limiter the span is a few milliseconds.
    """
    assert stamps[-1] - stamps[0] >= (len(stamps) - 2) / rate


def test_a_shared_limiter_defers_without_using_up_an_attempt(smtp):
    shared = RateLimiter(1.0)
    first = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", rate_limit=shared, timeout=0.5)
    second = EmailHandler("127.0.0.1", smtp.port, sender="news@example.com", rate_limit=shared, timeout=0.5)
    first(a_message())
    with pytest.raises(RetryLater) as deferred:
        second(a_message(key="k2"))
    assert not deferred.value.counts_as_attempt and deferred.value.delay is not None
    assert 0.5 < deferred.value.delay <= 1.0 and len(smtp.script.received) == 1


def test_concurrent_threads_share_the_rate_limit(smtp):
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com", rate_limit=5)
    failures: list[BaseException] = []

    def deliver(n: int) -> None:
        try:
            handler(a_message(key=f"k{n}"))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=deliver, args=(n,)) for n in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    stamps = sorted(r.at for r in smtp.script.received)
    assert len(stamps) == 5
    assert_spaced(stamps, 5)


# -- configuration ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"starttls": True, "ssl": True}, "starttls"),
        ({"sender": "no address"}, "sender"),
        ({"sender": "a@example.com\r\nBcc: v@example.com"}, "sender"),
        ({"sender": "=?utf-8?q?Shop=0D=0ABcc:_v@example.com?= <a@example.com>"}, "sender"),
        ({"username": "u"}, "username and password"),
        ({"timeout": 0}, "timeout"),
        ({"port": 0}, "port"),
        ({"host": "smtp.example.com\r\n"}, "host"),
        ({"rate_limit": -1}, "rate limit"),
        ({"sent_log": "sqlite://"}, "sent_log"),
        ({"templates": 42}, "templates"),
        ({"context_loader": "load"}, "context_loader"),
    ],
)
def test_bad_configuration_fails_at_construction(options: dict[str, Any], match: str):
    with pytest.raises(ConfigurationError, match=match):
        EmailHandler(**{"sender": "a@example.com", **options})


def test_a_missing_templates_folder_fails_at_construction(tmp_path):
    with pytest.raises(ConfigurationError, match="templates folder"):
        EmailHandler(sender="a@example.com", templates=tmp_path / "missing")


def test_a_server_that_is_down_or_busy_before_the_message_costs_no_attempt():
    """Refused, or '421 busy' at the greeting: nothing is known of the message, so no attempt is used."""
    handler = EmailHandler("127.0.0.1", free_port(), sender="shop@example.com", timeout=2)
    with pytest.raises(RetryLater) as refused:
        handler(a_message())
    assert not refused.value.counts_as_attempt and refused.value.detail["reason"] == "unavailable"
    assert "not counted" in str(refused.value)

    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def greet_busy() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"421 mail.example.com too busy, try later\r\n")

        greeter = threading.Thread(target=greet_busy, daemon=True)
        greeter.start()
        busy = EmailHandler("127.0.0.1", listener.getsockname()[1], sender="shop@example.com", timeout=2)
        with pytest.raises(RetryLater) as turned_away:
            busy(a_message())
        greeter.join(5)
    assert not turned_away.value.counts_as_attempt
    assert (
        turned_away.value.detail["smtp_code"] == 421 and turned_away.value.detail["smtp_stage"] == "connect"
    )


def test_a_temporary_refusal_of_the_message_itself_still_counts(smtp):
    """A 4xx once the server has heard of the message is about the message: a counted attempt."""
    smtp.script.data_replies = ["451 4.3.0 mailbox temporarily unavailable"]
    handler = EmailHandler("127.0.0.1", smtp.port, sender="shop@example.com")
    with pytest.raises(RetryLater) as raised:
        handler(a_message())
    assert raised.value.counts_as_attempt and raised.value.detail["smtp_stage"] == "data"
