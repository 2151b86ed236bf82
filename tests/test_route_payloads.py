"""Routes shape their own payload (``transform=``) and handlers check it at emit (``outbox_validate``).

One event, several routes: each row stores the payload its route made, each
handler receives that payload, and a payload a route cannot use is refused in
the request with a ``PayloadError`` that names the route; nothing of the
event is stored then, on any route, and the transaction carries on.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool
from test_email import SENDER, Smtp, parts_of, start_server
from test_webhook import LOCAL, SECRET, Receiver, serve
from test_write_side import nested

import outbox
from outbox import ConfigurationError, Message, Outbox, PayloadError, Route, emit
from outbox.integrations.email import EmailHandler, SentLog
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay

m = outbox.outbox_message
DOCS = Path(__file__).resolve().parents[1] / "docs"


def stored(engine: Engine) -> list[tuple[str, Any]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(m.c.handler, m.c.payload).order_by(m.c.id))]


def rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(m).order_by(m.c.id)))


def noop(msg: Message) -> None:
    pass


def receipt(payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "to": payload["email"],
        "subject": f"Receipt for order {payload['order_id']}",
        "text": f"You paid {payload['total']}.",
    }


def public(payload: dict[str, Any]) -> dict[str, Any]:
    return {"order_id": payload["order_id"], "total": payload["total"]}


PAID = {"order_id": 7, "total": "19.90", "email": "ada@example.com", "card_last4": "4242"}


@pytest.fixture
def ob() -> Outbox:
    return Outbox()


class Checked:
    """A handler object with an emit-time check, recording what it was shown."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.seen: list[Any] = []
        self.refuse = refuse

    def __call__(self, msg: Message) -> None:
        pass

    def outbox_validate(self, payload: Any) -> None:
        self.seen.append(payload)
        if self.refuse is not None:
            raise self.refuse


# -- the core: each route's row, all or nothing ------------------------------------------------------


def test_each_route_stores_its_own_payload_with_the_events_identity(engine, ob, maker):
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="receipt", transform=receipt)
    ob.route("order.paid", noop, name="partner", transform=public)
    payload = dict(PAID)
    with maker.begin() as s:
        event_id = emit(s, "order.paid", payload, key="paid:7", group_key="order:7")
    with maker.begin() as s:  # the same key again: stored once per route, as without transforms
        assert emit(s, "order.paid", payload, key="paid:7", group_key="order:7") == event_id

    assert stored(engine) == [("audit", PAID), ("receipt", receipt(PAID)), ("partner", public(PAID))]
    assert {(r.event_id, r.idempotency_key, r.group_key, r.event_type) for r in rows(engine)} == {
        (event_id, "paid:7", "order:7", "order.paid")
    }
    assert payload == PAID


def test_each_transform_gets_its_own_copy_of_the_event_payload(engine, ob, maker):
    def strip_card(payload: dict[str, Any]) -> dict[str, Any]:
        del payload["card_last4"]  # mutating its argument changes nothing outside this route
        payload["items"].append("gift")
        return payload

    ob.route("order.paid", noop, name="first", transform=strip_card)
    ob.route("order.paid", noop, name="second", transform=lambda p: p)
    payload = {**PAID, "items": ("book",)}  # a tuple: transforms see what a handler would, a list
    with maker.begin() as s:
        emit(s, "order.paid", payload)
    first, second = stored(engine)
    assert first == ("first", {**public(PAID), "email": PAID["email"], "items": ["book", "gift"]})
    assert second == ("second", {**PAID, "items": ["book"]})
    assert payload == {**PAID, "items": ("book",)}


def test_a_failing_transform_refuses_the_whole_emit_and_the_transaction_carries_on(engine, ob, maker):
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="receipt", transform=receipt)
    ob.route("order.shipped", noop, name="tracking")
    with maker.begin() as s:
        with pytest.raises(PayloadError) as refused:
            emit(s, "order.paid", {"order_id": 7, "total": "1.00"})  # no "email"
        emit(s, "order.shipped", {"order_id": 7})  # the same transaction, still usable
    assert (
        str(refused.value)
        == "route 'receipt': transform of the 'order.paid' payload failed: KeyError: 'email'"
    )
    assert isinstance(refused.value.__cause__, KeyError)
    assert stored(engine) == [("tracking", {"order_id": 7})]  # nothing of order.paid, on any route


@pytest.mark.parametrize(
    ("transform", "problem"),
    [
        (lambda p: {"on": date(2026, 1, 1)}, r"payload\['on'\] is a date, which is not JSON-serialisable"),
        (lambda p: ["not", "an", "object"], "payload must be a JSON object"),
        (lambda p: None, "payload must be a JSON object"),
        (lambda p: {"blob": "x" * 70_000}, "over the limit of 65536 bytes"),
        (lambda p: {"text": "a\x00b"}, "NUL character"),
        (lambda p: nested(65), "nested 65 levels deep, over the limit of 64"),
    ],
)
def test_a_transform_result_that_cannot_be_stored_is_refused_naming_the_route(
    engine, ob, maker, transform, problem
):
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="shaped", transform=transform)
    with maker.begin() as s, pytest.raises(PayloadError) as refused:
        emit(s, "order.paid", {"order_id": 1})
    message = str(refused.value)
    assert message.startswith(
        "route 'shaped': transform of the 'order.paid' payload returned one that cannot"
    )
    assert re.search(problem, message)
    assert stored(engine) == []


def test_the_events_own_payload_is_still_checked_before_any_transform(engine, ob, maker):
    calls: list[Any] = []
    ob.route("order.paid", noop, name="shaped", transform=lambda p: calls.append(p) or {"ok": True})
    with maker.begin() as s, pytest.raises(PayloadError, match=r"^payload\['on'\] is a date"):
        emit(s, "order.paid", {"on": date(2026, 1, 1)})
    assert calls == [] and stored(engine) == []


def test_transforms_must_be_plain_functions_and_validators_too():
    ob = Outbox()

    async def shape(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    class AsyncCall:
        async def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
            return payload

    class AsyncValidate:
        def __call__(self, msg: Message) -> None: ...

        async def outbox_validate(self, payload: Any) -> None: ...

    for bad in (shape, AsyncCall(), "receipt"):
        with pytest.raises(ConfigurationError, match="route 'r': transform must be"):
            ob.route("order.paid", noop, name="r", transform=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="route 'd': transform must be a plain function"):

        @ob.handler("order.paid", name="d", transform=shape)
        def decorated(msg: Message) -> None: ...

    with pytest.raises(ConfigurationError, match="route 'v': the handler's outbox_validate must be a plain"):
        ob.route("order.paid", AsyncValidate(), name="v")
    assert ob.routes == ()  # nothing half-registered


def test_routes_find_their_validator_once_at_registration():
    ob = Outbox()
    plain = ob.route("order.paid", noop, name="plain")
    checked = ob.route("order.paid", Checked(), name="checked", transform=public)
    assert plain.validator is None and plain.transform is None
    assert checked.validator is not None and checked.transform is public
    assert isinstance(checked, Route)


def test_the_validator_sees_its_routes_payload_and_its_refusal_names_the_route(engine, ob, maker):
    checked = Checked()
    ob.route("order.paid", checked, name="partner", transform=public)
    ob.route("order.paid", noop, name="audit")
    with maker.begin() as s:
        emit(s, "order.paid", PAID)
    assert checked.seen == [public(PAID)]

    checked.refuse = PayloadError("total must be a number")
    with maker.begin() as s:
        with pytest.raises(PayloadError) as refused:
            emit(s, "order.paid", PAID)
        assert str(refused.value) == (
            "route 'partner' refuses this 'order.paid' payload: total must be a number"
        )
        checked.refuse = ValueError("boom")  # any exception is a refusal, chained
        with pytest.raises(PayloadError, match="^route 'partner' refuses .*: ValueError: boom$") as wrapped:
            emit(s, "order.paid", PAID)
        assert wrapped.value.__cause__ is checked.refuse
    assert [h for h, _ in stored(engine)] == ["partner", "audit"]  # the first emit only


# -- every write path: flush, commit, big commits, async sessions, the pipelined commit --------------


def test_per_route_payloads_survive_a_flush_and_a_big_chunked_commit(engine, ob, maker):
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="partner", transform=lambda p: {"n": p["n"], "route": "partner"})
    with maker.begin() as s:
        emit(s, "order.paid", {"n": -1, "secret": "x"})
        s.flush()  # nothing else to flush: written at commit with the rest
        for n in range(700):  # 1,402 rows: more than one INSERT statement on psycopg
            emit(s, "order.paid", {"n": n, "secret": "x"})
    got = stored(engine)
    assert len(got) == 1402
    assert got[:2] == [("audit", {"n": -1, "secret": "x"}), ("partner", {"n": -1, "route": "partner"})]
    assert got[-2:] == [("audit", {"n": 699, "secret": "x"}), ("partner", {"n": 699, "route": "partner"})]
    assert all(
        p == ({"n": p["n"], "route": "partner"} if h == "partner" else {"n": p["n"], "secret": "x"})
        for h, p in got
    )


def test_an_async_session_stores_each_routes_payload(engine, database_url, ob):
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    driver = "sqlite+aiosqlite" if url.get_backend_name() == "sqlite" else "postgresql+psycopg"
    async_engine = create_async_engine(url.set(drivername=driver), poolclass=NullPool)
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="partner", transform=public)
    Sessions = async_sessionmaker(async_engine)
    ob.install(Sessions)

    async def main() -> None:
        async with Sessions() as s, s.begin():
            emit(s, "order.paid", PAID)
            with pytest.raises(PayloadError, match="^route 'partner': transform"):
                emit(s, "order.paid", {"order_id": 8})
        await async_engine.dispose()

    try:
        asyncio.run(main())
    finally:
        ob.uninstall(Sessions)
    assert stored(engine) == [("audit", PAID), ("partner", public(PAID))]


@pytest.mark.postgres
def test_the_pipelined_commit_writes_each_routes_payload(pg_engine):
    ob = Outbox()  # pipeline_writes=True, the default
    ob.route("order.paid", noop, name="audit")
    ob.route("order.paid", noop, name="partner", transform=public)
    factory = sessionmaker(pg_engine)
    ob.install(factory)
    seen: list[str] = []

    @event.listens_for(pg_engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if "outbox_message" in statement:
            seen.append(statement)

    try:
        with factory() as s, s.begin():
            emit(s, "order.paid", PAID, key="paid:7")
    finally:
        ob.uninstall(factory)
    assert seen == []  # the INSERT rode with the COMMIT, out of SQLAlchemy's sight
    assert stored(pg_engine) == [("audit", PAID), ("partner", public(PAID))]


# -- the handlers: email and webhook routes of one event, delivered for real ------------------------------


@pytest.fixture
def smtp(request: pytest.FixtureRequest) -> Smtp:
    return start_server(request)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from serve(Receiver())


def shop(
    engine: Engine, smtp_port: int, hook_url: str | None, **webhook: Any
) -> tuple[Outbox, sessionmaker[Session]]:
    ob = Outbox()
    ob.route(
        "order.paid",
        EmailHandler("127.0.0.1", smtp_port, sender=SENDER, sent_log=SentLog(engine)),
        name="receipt_email",
        transform=receipt,
    )
    ob.route(
        "order.paid",
        WebhookHandler(hook_url, SECRET, allowed_networks=LOCAL, **webhook),
        name="partner_webhook",
        transform=public if hook_url is not None else lambda p: {"url": p["hook"], **public(p)},
    )
    factory = sessionmaker(engine)
    ob.install(factory)
    return ob, factory


def test_one_event_feeds_an_email_and_a_webhook_each_with_its_own_payload(engine, smtp, receiver):
    ob, factory = shop(engine, smtp.port, receiver.url())
    with factory.begin() as s:
        emit(s, "order.paid", PAID, key="paid:7")
    assert stored(engine) == [("receipt_email", receipt(PAID)), ("partner_webhook", public(PAID))]

    result = Relay(ob, engine).run_until_idle()
    assert result.delivered == 2
    [mail] = smtp.script.received
    assert mail.rcpt_tos == ["ada@example.com"]
    assert mail.mail["Subject"] == "Receipt for order 7"
    assert parts_of(mail.mail) == {"text/plain": "You paid 19.90."}
    [request] = receiver.requests
    assert json.loads(request.body) == {"order_id": 7, "total": "19.90"}  # no email, no card


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"email": None}, "payload 'to' must be an address or a list"),
        ({"email": "ada@example.com, bob@example.com"}, "payload 'to': invalid address"),
        ({"email": "ada@example.com\r\nBcc: eve@example.com"}, "header injection refused"),
    ],
)
def test_a_mail_without_a_usable_to_is_refused_at_emit_naming_the_route(
    engine, smtp, receiver, payload, problem
):
    ob, factory = shop(engine, smtp.port, receiver.url())
    with factory.begin() as s:
        with pytest.raises(PayloadError) as refused:
            emit(s, "order.paid", {**PAID, **payload})
        emit(s, "order.paid", PAID)  # caught: the transaction goes on and commits
    assert str(refused.value).startswith("route 'receipt_email' refuses this 'order.paid' payload: ")
    assert problem in str(refused.value)
    assert [h for h, _ in stored(engine)] == ["receipt_email", "partner_webhook"]


def test_email_validation_checks_subject_body_and_templates_as_delivery_would(tmp_path):
    import jinja2

    plain = EmailHandler(sender=SENDER, sent_log=False)
    templated = EmailHandler(
        sender=SENDER,
        sent_log=False,
        templates=jinja2.DictLoader(
            {
                "ok.subject.txt": "Hi",
                "ok.txt": "t",
                "subject_only.subject.txt": "x",
                "broken.subject.txt": "{% if %}",
                "broken.txt": "t",
            }
        ),
    )
    to = {"to": ["ada@example.com", "Bob <bob@example.com>"]}
    plain.outbox_validate({**to, "subject": "S", "text": "t"})
    plain.outbox_validate({**to, "subject": "S", "html": "<p>h</p>"})
    templated.outbox_validate({**to, "template": "ok", "context": {"name": "Ada"}})
    for handler, payload, problem in [
        (plain, {**to, "text": "t"}, "payload needs 'subject'"),
        (plain, {**to, "subject": "S"}, "payload needs 'text' and/or 'html' strings"),
        (plain, {**to, "subject": "S", "text": 3}, "payload needs 'text' and/or 'html' strings"),
        (plain, {**to, "subject": "S\nBcc: x@example.com", "text": "t"}, "header injection refused"),
        (plain, {**to, "template": "ok"}, "no templates="),
        (templated, {**to, "template": "ok", "subject": "S"}, "both 'template' and"),
        (templated, {**to, "template": "../ok"}, "invalid template name"),
        (templated, {**to, "template": "ok", "context": []}, "'context' must be an object"),
        (templated, {**to, "template": "absent"}, "absent.subject.txt not found"),
        (templated, {**to, "template": "subject_only"}, "neither subject_only.txt nor"),
        (templated, {**to, "template": "broken"}, "template broken failed: TemplateSyntaxError"),
        (plain, {"to": [], "subject": "S", "text": "t"}, "payload 'to' must be"),
    ]:
        with pytest.raises(PayloadError, match=re.escape(problem)):
            handler.outbox_validate(payload)


def test_a_payload_url_outside_the_webhook_policy_is_refused_at_emit_without_dns(
    engine, smtp, receiver, monkeypatch
):
    ob, factory = shop(engine, smtp.port, None)

    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("emit must not resolve host names")

    monkeypatch.setattr("socket.getaddrinfo", no_dns)
    monkeypatch.setattr("asyncio.base_events.BaseEventLoop.getaddrinfo", no_dns)
    refusals = {
        "http://169.254.169.254/latest/meta-data/": "link-local address (SSRF guard)",
        "http://10.0.0.7/hooks": "private address (SSRF guard)",
        "http://[::1]:9/hooks": "loopback address (SSRF guard)",  # 127.0.0.0/8 is allowed, ::1 is not
        "ftp://partner.example/hooks": "webhook URLs must be http or https",
        "https://user:pw@partner.example/hooks": "must not carry credentials",
    }
    with factory.begin() as s:
        for url, problem in refusals.items():
            with pytest.raises(PayloadError) as refused:
                emit(s, "order.paid", {**PAID, "hook": url})
            assert str(refused.value).startswith(
                "route 'partner_webhook' refuses this 'order.paid' payload: "
            )
            assert problem in str(refused.value)
        # A name is judged on its addresses at delivery, never here; an allowed literal passes.
        emit(s, "order.paid", {**PAID, "hook": "https://partner.example/hooks"})
        emit(s, "order.paid", {**PAID, "hook": receiver.url()})
    assert len(stored(engine)) == 4


def test_localhost_is_judged_as_loopback_at_emit():
    guarded = WebhookHandler(secret=SECRET)
    for url in ("http://localhost/h", "http://LOCALHOST./h", "http://api.localhost:8080/h"):
        with pytest.raises(PayloadError, match="loopback address"):
            guarded.outbox_validate({"url": url})
    WebhookHandler(secret=SECRET, allowed_networks=LOCAL).outbox_validate({"url": "http://localhost/h"})
    # With a fixed URL the payload is only a body: nothing in it is a destination.
    WebhookHandler("https://partner.example/hooks", SECRET).outbox_validate({"url": "http://10.0.0.1/"})


def test_a_payload_url_route_delivers_to_the_url_its_transform_chose(engine, smtp, receiver):
    ob, factory = shop(engine, smtp.port, None)
    with factory.begin() as s:
        emit(s, "order.paid", {**PAID, "hook": receiver.url("/partner/7")})
    assert Relay(ob, engine).run_until_idle().delivered == 2
    [request] = receiver.requests
    assert request.path == "/partner/7"
    assert json.loads(request.body) == {"url": receiver.url("/partner/7"), **public(PAID)}


# -- the guides' examples run as written ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("guide", "script"),
    [("emitting.md", "shaping.py"), ("email.md", "email_routes.py"), ("webhooks.md", "webhook_routes.py")],
)
def test_the_guides_route_shaping_examples_print_what_they_show(tmp_path, guide, script):
    found = re.findall(
        rf"```python\n(# {re.escape(script)}\n.*?)```\n\n```console\n\$ python {re.escape(script)}\n(.*?)```",
        (DOCS / guide).read_text(),
        re.S,
    )
    assert len(found) == 1, f"{guide} should hold one example '# {script}' followed by its output"
    code, output = found[0]
    (tmp_path / script).write_text(code)
    run = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == output.splitlines()
