"""EmailHandler against a real aiosmtpd server on 127.0.0.1, through the real relay."""

from __future__ import annotations

import email
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Outbox, emit
from outbox.integrations.email import EmailHandler, SentLog, outbox_email_sent
from outbox.relay import Relay

m, a = outbox.outbox_message, outbox.outbox_attempt
SECRET_PASSWORD = "s3cr3t-smtp-pass-do-not-log"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Script:
    """What the server answers to DATA, one reply per mail in order; then 250 for ever."""

    def __init__(self) -> None:
        self.replies: list[str] = []
        self.received: list[tuple[float, email.message.Message]] = []
        self.drop_next = False

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        if self.drop_next:
            self.drop_next = False
            server.transport.close()  # the connection dies mid-DATA, before any reply
            return "421 closing"
        reply = self.replies.pop(0) if self.replies else "250 OK"
        if reply.startswith("250"):
            self.received.append((time.monotonic(), email.message_from_bytes(envelope.content)))
        return reply


def reject_auth(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
    return AuthResult(success=False, handled=False)


@pytest.fixture
def smtp() -> Iterator[tuple[Script, int]]:
    script = Script()
    controller = Controller(
        script, hostname="127.0.0.1", port=free_port(), authenticator=reject_auth, auth_require_tls=False
    )
    controller.start()
    try:
        yield script, int(controller.port)
    finally:
        controller.stop()


def setup(engine: Engine, port: int, **options: Any) -> tuple[Outbox, sessionmaker[Any]]:
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))
    ob.route(
        "mail",
        EmailHandler(
            "127.0.0.1", port, sender="Shop <shop@example.com>", sent_log=SentLog(engine), **options
        ),
        name="mailer",
        max_attempts=4,
        timeout=10,
    )
    factory = sessionmaker(engine)
    ob.install(factory)
    return ob, factory


def drain_all(ob: Outbox, engine: Engine) -> None:
    for _ in range(50):
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            if not conn.execute(select(func.count()).where(m.c.status.in_(("pending", "running")))).scalar():
                return
        time.sleep(0.01)


def outcomes(engine: Engine) -> list[tuple[str, Any]]:
    with engine.connect() as conn:
        return [(r.outcome, r.detail) for r in conn.execute(select(a).order_by(a.c.id))]


def test_delivers_multipart_mail_with_a_stable_message_id(engine, smtp):
    script, port = smtp
    ob, factory = setup(engine, port)
    with factory() as s, s.begin():
        emit(
            s,
            "mail",
            {"to": ["Ada <ada@example.com>"], "subject": "Hi", "text": "plain", "html": "<b>x</b>"},
            key="welcome:ada",
        )
    drain_all(ob, engine)
    assert len(script.received) == 1
    mail = script.received[0][1]
    assert mail["From"] == "Shop <shop@example.com>" and mail["To"] == "Ada <ada@example.com>"
    assert mail["Subject"] == "Hi" and mail.get_content_type() == "multipart/alternative"
    parts = {
        p.get_content_type(): p.get_payload(decode=True).decode().strip()
        for p in mail.walk()
        if not p.is_multipart()
    }
    assert parts == {"text/plain": "plain", "text/html": "<b>x</b>"}
    with engine.connect() as conn:
        logged = conn.execute(select(outbox_email_sent.c.message_id)).scalars().all()
    assert logged == [mail["Message-ID"]] and mail["Message-ID"].endswith("@example.com>")


def test_451_is_retried_and_sends_one_mail(engine, smtp):
    script, port = smtp
    script.replies = ["451 4.3.0 try again later"]
    ob, factory = setup(engine, port)
    with factory() as s, s.begin():
        emit(s, "mail", {"to": "a@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert len(script.received) == 1
    got = outcomes(engine)
    assert [o for o, _ in got] == ["retry", "delivered"]
    assert got[0][1]["smtp_code"] == 451


def test_550_is_dead_at_once_with_the_code_recorded(engine, smtp):
    script, port = smtp
    script.replies = ["550 5.1.1 no such user"]
    ob, factory = setup(engine, port)
    with factory() as s, s.begin():
        emit(s, "mail", {"to": "nobody@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert script.received == []
    assert [(o, d["smtp_code"]) for o, d in outcomes(engine)] == [("dead", 550)]


def test_connection_dropped_mid_data_is_retried_and_still_one_mail(engine, smtp):
    script, port = smtp
    script.drop_next = True
    ob, factory = setup(engine, port)
    with factory() as s, s.begin():
        emit(s, "mail", {"to": "a@example.com", "subject": "S", "text": "t"})
    drain_all(ob, engine)
    assert len(script.received) == 1
    assert [o for o, _ in outcomes(engine)] == ["retry", "delivered"]


def test_a_message_the_server_already_accepted_is_not_sent_again(engine, smtp):
    script, port = smtp
    handler = EmailHandler("127.0.0.1", port, sender="shop@example.com", sent_log=engine)
    msg = outbox.Message(
        id=7,
        event_id=__import__("uuid").uuid4(),
        event_type="mail",
        handler="mailer",
        payload={"to": "a@example.com", "subject": "S", "text": "t"},
        key="k1",
    )
    first = handler(msg)
    again = handler(msg)  # a retry after a crash between acceptance and the relay's record
    assert len(script.received) == 1
    assert again["skipped"] and again["message_id"] == first["message_id"]


@pytest.mark.parametrize(
    "payload",
    [
        {"to": "a@example.com", "subject": "Hi\r\nBcc: victim@example.com", "text": "t"},
        {"to": "a@example.com\nBcc: victim@example.com", "subject": "S", "text": "t"},
        {"to": "not-an-address", "subject": "S", "text": "t"},
    ],
)
def test_header_injection_and_bad_addresses_are_dead_not_sent(engine, smtp, payload):
    script, port = smtp
    ob, factory = setup(engine, port)
    with factory() as s, s.begin():
        emit(s, "mail", payload)
    drain_all(ob, engine)
    assert script.received == []
    assert [o for o, _ in outcomes(engine)] == ["dead"]


def test_authentication_failure_is_loud_and_never_leaks_the_password(engine, smtp, caplog):
    script, port = smtp
    ob, factory = setup(engine, port, username="shop", password=SECRET_PASSWORD)
    with factory() as s, s.begin():
        emit(s, "mail", {"to": "a@example.com", "subject": "S", "text": "t"})
    with caplog.at_level(logging.DEBUG):
        drain_all(ob, engine)
    assert [o for o, _ in outcomes(engine)] == ["dead"]
    assert any(getattr(r, "action", None) == "smtp_auth_failed" for r in caplog.records)
    with engine.connect() as conn:
        stored = " ".join(str(tuple(r)) for t in (m, a) for r in conn.execute(select(t)))
    assert SECRET_PASSWORD not in stored and SECRET_PASSWORD not in caplog.text
    assert SECRET_PASSWORD not in repr(ob.routes[0].handler)


def test_templates_render_subject_text_and_escaped_html(engine, smtp, tmp_path):
    script, port = smtp
    (tmp_path / "welcome.subject.txt").write_text("Welcome, {{ name }}")
    (tmp_path / "welcome.txt").write_text("Hello {{ name }}")
    (tmp_path / "welcome.html").write_text("<p>Hello {{ name }}</p>")
    ob, factory = setup(engine, port, templates=tmp_path)
    with factory() as s, s.begin():
        emit(s, "mail", {"to": "a@example.com", "template": "welcome", "context": {"name": "<Ada>"}})
    drain_all(ob, engine)
    mail = script.received[0][1]
    assert mail["Subject"] == "Welcome, <Ada>"
    html = next(p for p in mail.walk() if p.get_content_type() == "text/html").get_payload(decode=True)
    assert b"&lt;Ada&gt;" in html


def test_rate_limit_spaces_deliveries_as_the_server_sees_them(engine, smtp):
    script, port = smtp
    ob, factory = setup(engine, port, rate_limit=10)
    with factory() as s, s.begin():
        for n in range(5):
            emit(s, "mail", {"to": "a@example.com", "subject": f"S{n}", "text": "t"})
    Relay(ob, engine, concurrency=5).run_until_idle()
    stamps = sorted(t for t, _ in script.received)
    assert len(stamps) == 5
    assert stamps[-1] - stamps[0] >= 0.3  # 4 gaps of 0.1 s at 10/s, generous for a busy machine


def test_bad_configuration_fails_at_construction(tmp_path):
    with pytest.raises(ConfigurationError, match="starttls"):
        EmailHandler(sender="a@example.com", starttls=True, ssl=True)
    with pytest.raises(ConfigurationError, match="sender"):
        EmailHandler(sender="no address")
    with pytest.raises(ConfigurationError, match="templates folder"):
        EmailHandler(sender="a@example.com", templates=tmp_path / "missing")
