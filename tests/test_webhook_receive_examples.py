"""The webhook receiver examples on real HTTP servers, fed by this outbox's relay, on SQLite and PostgreSQL.

examples/webhook_receiver_fastapi.py runs under uvicorn and
examples/webhook_receiver_flask.py on werkzeug's server, each in a thread on
127.0.0.1. A relay delivers ``order.paid`` events to it with
``WebhookHandler`` over real HTTP, from a sender database of the same kind as
the receiver's. Between them sits a wrapper that records every answer the
application gives and can lose the next ones (the application has committed;
the sender gets a 500), the way a dropped connection or a proxy would. Each
test checks one effect per event through lost answers, a resend, a requeue and
a failing handler, and that a forged request is refused with 401 and stores
nothing.
"""

from __future__ import annotations

import re
import socket
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session

import outbox
from outbox import Inbox, InboxMessage, Message, Outbox, emit
from outbox.integrations.webhook import WebhookHandler, generate_secret, webhook_id
from outbox.ops import MessageFilter, requeue, resend
from outbox.relay import Relay

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LOCAL = ["127.0.0.0/8"]
m, a, markers = outbox.outbox_message, outbox.outbox_attempt, outbox.outbox_inbox


# -- the answers the application gives, and the ones the sender never gets ---------------------------


class Answers:
    """Every answer of the application, by webhook-id; the next ``lose`` of them never reach the sender."""

    def __init__(self) -> None:
        self.lose = 0
        self.given: list[tuple[str, int, str]] = []
        self._lock = threading.Lock()

    def record(self, webhook: str, status: int, body: bytes) -> bool:
        """Note the answer; True if the sender gets a 500 instead."""
        with self._lock:
            self.given.append((webhook, status, body.decode()))
            if self.lose:
                self.lose -= 1
                return True
            return False

    def to(self, webhook: str) -> list[tuple[int, str]]:
        return [(status, reason) for w, status, reason in self.given if w == webhook]


def asgi_recording(app: Any, answers: Answers) -> Any:
    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # the lifespan goes through as it is
            await app(scope, receive, send)
            return
        webhook = dict(scope["headers"]).get(b"webhook-id", b"").decode()
        got: dict[str, Any] = {"body": b""}

        async def keep(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                got["status"] = message["status"]
            elif message["type"] == "http.response.body":
                got["body"] += message.get("body", b"")

        await app(scope, receive, keep)
        lost = answers.record(webhook, got["status"], got["body"])
        status, body = (500, b"answer lost") if lost else (got["status"], got["body"])
        headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return wrapped


def wsgi_recording(app: Any, answers: Answers) -> Any:
    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        got: dict[str, Any] = {}

        def keep(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            got["status"] = status
            return lambda data: None

        chunks = app(environ, keep)
        try:
            body = b"".join(chunks)
        finally:
            getattr(chunks, "close", lambda: None)()
        lost = answers.record(environ.get("HTTP_WEBHOOK_ID", ""), int(got["status"].split()[0]), body)
        status, body = ("500 Internal Server Error", b"answer lost") if lost else (got["status"], body)
        start_response(status, [("content-type", "text/plain"), ("content-length", str(len(body)))])
        return [body]

    return wrapped


# -- the examples' servers ----------------------------------------------------------------------------


@contextmanager
def fastapi_serving(database_url: str, secret: str, answers: Answers) -> Iterator[tuple[str, Inbox]]:
    import uvicorn
    import webhook_receiver_fastapi as example

    async_url = make_url(database_url)
    async_url = async_url.set(
        drivername={"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg"}[
            async_url.get_backend_name()
        ]
    )
    app = example.create_app(async_url.render_as_string(hide_password=False), secret)
    server = uvicorn.Server(uvicorn.Config(asgi_recording(app, answers), lifespan="on", log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:  # the lifespan (migrations, tables) has run and the socket listens
            assert thread.is_alive(), "uvicorn stopped during start-up"
            assert time.monotonic() < deadline, "uvicorn did not start within 60 s"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", example.inbox
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
    assert not thread.is_alive()


@contextmanager
def flask_serving(database_url: str, secret: str, answers: Answers) -> Iterator[tuple[str, Inbox]]:
    import webhook_receiver_flask as example
    from werkzeug.serving import make_server

    app = example.create_app(database_url, secret)
    server = make_server("127.0.0.1", 0, wsgi_recording(app, answers), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", example.inbox
    finally:
        server.shutdown()
        server.server_close()
        thread.join(60)


#: The next handler calls of the examples' inbox that fail (a test's own handler, registered once).
failing: list[BaseException] = []


def fail_on_demand(inbox: Inbox) -> None:
    """Add a handler after the example's own that raises what ``failing`` holds: the payment rolls back."""
    if any(h.name == "fails_on_demand" for h in inbox.handlers):
        return

    def fails_on_demand(session: Session, message: InboxMessage) -> None:
        if failing:
            raise failing.pop(0)

    inbox.handler("order.paid", name="fails_on_demand")(fails_on_demand)


SERVERS = {"fastapi": fastapi_serving, "flask": flask_serving}


@pytest.fixture(params=sorted(SERVERS))
def framework(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return str(request.param)


@pytest.fixture
def receiver_url(database_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The receiver's own database, of the sender's kind: a new SQLite file, or a migrated PostgreSQL one."""
    if make_url(database_url).get_backend_name() == "sqlite":
        return f"sqlite:///{tmp_path / 'receiver.db'}"  # empty: the example migrates it at start-up
    return str(request.getfixturevalue("pg_url"))


# -- the sender -------------------------------------------------------------------------------------------


def deliver(ob: Outbox, engine: Engine) -> None:
    """Run the relay until no message is pending or running (retries fall due within milliseconds)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        Relay(ob, engine, listen=False).run_until_idle()
        with engine.connect() as conn:
            left = conn.execute(
                select(func.count()).where(m.c.status.in_(["pending", "running"]))
            ).scalar_one()
        if not left:
            return
        time.sleep(0.01)
    raise AssertionError("the relay did not finish its messages within 120 s")


def sent_as(event_id: uuid.UUID, route: str) -> str:
    return webhook_id(Message(id=0, event_id=event_id, event_type="order.paid", handler=route, payload={}))


def history(engine: Engine, event_id: uuid.UUID) -> list[tuple[str, int | None]]:
    """(outcome, HTTP status) of every attempt at the event, copies included, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(a.c.outcome, a.c.detail)
            .join(m, m.c.id == a.c.message_id)
            .where(m.c.event_id == event_id)
            .order_by(a.c.id)
        ).all()
    return [(outcome, (detail or {}).get("status")) for outcome, detail in rows]


def message_ids(engine: Engine, event_id: uuid.UUID) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(select(m.c.id).where(m.c.event_id == event_id).order_by(m.c.id)).scalars())


def payments(url: str) -> dict[int, int]:
    """How many payments the receiver recorded for each order."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT order_id, count(*) FROM payments GROUP BY order_id").all()
            return {order_id: count for order_id, count in rows}
    finally:
        engine.dispose()


def receiver_markers(url: str) -> list[tuple[str, str]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(select(markers.c.message_id, markers.c.outcome))]
    finally:
        engine.dispose()


def test_each_event_takes_effect_once_at_the_receiver_whatever_the_sender_repeats(
    framework, receiver_url, engine, ob, maker
):
    secret = generate_secret()
    answers = Answers()
    failing.clear()
    with SERVERS[framework](receiver_url, secret, answers) as (base, inbox):
        fail_on_demand(inbox)
        url = f"{base}/hooks/order-paid"
        ob.route(
            "order.paid", WebhookHandler(url, secret, allowed_networks=LOCAL), name="partner", max_attempts=3
        )
        forger = WebhookHandler(url, generate_secret(), allowed_networks=LOCAL)  # not the receiver's secret
        ob.route("forged.order.paid", forger, name="forger", max_attempts=3)

        def paid(order_id: int, event_type: str = "order.paid") -> tuple[uuid.UUID, str]:
            with maker.begin() as session:
                event_id = emit(session, event_type, {"order_id": order_id, "total": f"{order_id}.00"})
            deliver(ob, engine)
            return event_id, sent_as(event_id, "forger" if event_type.startswith("forged") else "partner")

        # 1. Delivered once, answered once.
        first, first_hook = paid(1)
        assert answers.to(first_hook) == [(200, "handled")]
        assert history(engine, first) == [("delivered", 200)]

        # 2. The receiver committed, its answer was lost: the relay sends again and hears "duplicate".
        answers.lose = 1
        second, second_hook = paid(2)
        assert answers.to(second_hook) == [
            (200, "handled"),
            (200, "duplicate: received before, nothing done again"),
        ]
        assert history(engine, second) == [("retry", 500), ("delivered", 200)]

        # 3. An operator resends a delivered message: a copy with the same event, so the same webhook-id.
        resend(engine, MessageFilter(ids=message_ids(engine, first)), reason="partner lost it", actor="ops")
        deliver(ob, engine)
        assert answers.to(first_hook)[1:] == [(200, "duplicate: received before, nothing done again")]
        assert [o for o in history(engine, first) if o[0] != "resent"] == [
            ("delivered", 200),
            ("delivered", 200),
        ]

        # 4. Every answer lost until the sender gave up; a requeue of the dead message is a duplicate too.
        answers.lose = 3
        third, third_hook = paid(3)
        assert history(engine, third) == [("retry", 500), ("retry", 500), ("dead", 500)]
        requeue(engine, MessageFilter(ids=message_ids(engine, third)), reason="receiver is fine", actor="ops")
        deliver(ob, engine)
        assert [status for status, _ in answers.to(third_hook)] == [200] * 4
        assert answers.to(third_hook)[0][1] == "handled"
        assert history(engine, third)[-1] == ("delivered", 200)

        # 5. A handler fails: nothing stored, 500, the relay retries and the retry takes effect.
        failing.append(RuntimeError("ledger unavailable"))
        fourth, fourth_hook = paid(4)
        assert answers.to(fourth_hook) == [
            (500, "handler 'fails_on_demand' failed (RuntimeError); nothing stored, send it again"),
            (200, "handled"),
        ]
        assert history(engine, fourth) == [("retry", 500), ("delivered", 200)]

        # 6. A request signed with another secret: 401, nothing stored, the sender records it dead.
        forged, forged_hook = paid(5, "forged.order.paid")
        ((status, reason),) = answers.to(forged_hook)
        assert (status, reason) == (
            401,
            "webhook verification failed: no signature matches the secret(s): wrong secret or altered body",
        )
        assert history(engine, forged) == [("dead", 401)]
        with engine.connect() as conn:
            detail = conn.execute(
                select(a.c.detail).join(m, m.c.id == a.c.message_id).where(m.c.event_id == forged)
            ).scalar_one()
        assert detail["response"] == reason  # the sender's dead letter says why

    assert payments(receiver_url) == {1: 1, 2: 1, 3: 1, 4: 1}
    assert sorted(receiver_markers(receiver_url)) == sorted(
        (hook, "handled") for hook in (first_hook, second_hook, third_hook, fourth_hook)
    )


# -- the pages show the examples' code ------------------------------------------------------------------

SNIPPET = re.compile(r"<!-- snippet: (?P<file>[^#]+)#(?P<name>[\w-]+) -->\n```\w*\n(?P<code>.*?)```", re.S)


def section(path: Path, name: str) -> str:
    found = re.search(
        rf"[ \t]*# --8<-- \[start:{name}\]\n(.*?)[ \t]*# --8<-- \[end:{name}\]", path.read_text(), re.S
    )
    assert found, f"no section {name!r} in {path}"
    return textwrap.dedent(found.group(1)).rstrip("\n") + "\n"


def test_the_webhooks_page_shows_the_examples_code():
    snippets = list(SNIPPET.finditer((ROOT / "docs" / "webhooks.md").read_text()))
    assert {s["file"] for s in snippets} == {
        "examples/webhook_receiver_fastapi.py",
        "examples/webhook_receiver_flask.py",
    }
    for snippet in snippets:
        assert snippet["code"] == section(ROOT / snippet["file"], snippet["name"]), (
            f"{snippet['file']}#{snippet['name']} differs"
        )
