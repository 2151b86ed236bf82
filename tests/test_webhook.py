"""Webhooks against a real HTTP server on 127.0.0.1, through the real relay on SQLite and PostgreSQL.

Every request in this module goes to 127.0.0.0/8. Addresses elsewhere appear
only as DNS answers or redirect targets the handler must refuse before it
connects, and as inputs to the address classifier.
"""

from __future__ import annotations

import asyncio
import base64
import email.message
import errno
import ipaddress
import json
import logging
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from stamped import as_reported
from standardwebhooks.webhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError as ReferenceVerificationError
from tlscert import self_signed
from unchecked import store_unchecked

import outbox
from outbox import (
    ConfigurationError,
    Message,
    Outbox,
    PayloadError,
    PermanentError,
    RetryLater,
    emit,
)
from outbox.integrations._breaker import VOLUNTEER_GRACE, CircuitBreaker, CircuitOpen
from outbox.integrations._ratelimit import RateLimited, RateLimiter
from outbox.integrations._signing import sign
from outbox.integrations._ssrf import AddressPolicy, literal_address
from outbox.integrations._webhook_http import parse_target
from outbox.integrations.webhook import (
    WebhookHandler,
    WebhookVerificationError,
    generate_secret,
    retry_after,
    verify,
    webhook_id,
)
from outbox.relay import Relay

m = outbox.outbox_message
a = outbox.outbox_attempt

LOCAL = ["127.0.0.0/8"]
SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OLD_SECRET = "whsec_" + base64.b64encode(b"o" * 32).decode()


# -- a scripted HTTP receiver -------------------------------------------------------------


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    hang: float = 0.0  # seconds to stall before answering (released early at teardown)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class _Server(ThreadingHTTPServer):
    request_queue_size = 512  # a burst of concurrent connects is accepted, not dropped at listen()


class Receiver:
    """A ThreadingHTTPServer on 127.0.0.1 answering POSTs from a script (then ``default``)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.script: list[Reply | Callable[[Received], Reply]] = []
        self.server_names: list[str | None] = []  # TLS SNI of each handshake
        self.default: Reply | Callable[[Received], Reply] = Reply()
        self.requests: list[Received] = []
        self.released = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                seen = Received(
                    self.path, {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()
                )
                with receiver._lock:
                    receiver.requests.append(seen)
                    step = receiver.script.pop(0) if receiver.script else receiver.default
                reply = step(seen) if callable(step) else step
                if reply.hang:
                    receiver.released.wait(reply.hang)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            tls.sni_callback = lambda sock, name, ctx: self.server_names.append(name)
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def serve(r: Receiver) -> Iterator[Receiver]:
    r.thread.start()
    yield r
    r.released.set()
    r.server.shutdown()
    r.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from serve(Receiver())


TLS_NAME = "hooks.example.test"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for TLS_NAME only (not for 127.0.0.1)."""
    return self_signed(tmp_path_factory.mktemp("tls"), TLS_NAME, f"DNS:{TLS_NAME}")


@pytest.fixture
def tls_receiver(certificate: tuple[Path, Path]) -> Iterator[Receiver]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    yield from serve(Receiver(tls=context))


# -- relay plumbing -------------------------------------------------------------------------


def emit_one(maker: sessionmaker[Session], event_type: str, payload: dict[str, Any], **options: Any) -> None:
    with maker() as s, s.begin():
        emit(s, event_type, payload, **options)


def drain(ob: Outbox, engine: Engine) -> None:
    """Run the relay until nothing pending is due soon (millisecond backoffs fall due as we loop).

    A retry scheduled well ahead (a Retry-After, an open breaker) is left for the test to inspect.
    """
    for _ in range(200):
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            pending = conn.execute(
                select(m.c.available_at, m.c.updated_at).where(m.c.status == "pending")
            ).all()
        if all((r.available_at - r.updated_at).total_seconds() > 0.2 for r in pending):
            return
        time.sleep(0.005)
    raise AssertionError("the relay never went idle")


def the_message(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(m)).one()


def history(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(a).order_by(a.c.id)))


def make_due(engine: Engine) -> None:
    """Skip a deliberate wait without sleeping through it (the wait itself was asserted)."""
    with engine.begin() as conn:
        conn.execute(update(m).where(m.c.status == "pending").values(available_at=m.c.created_at))


def message(payload: dict[str, Any], **fields: Any) -> Message:
    defaults: dict[str, Any] = {
        "id": 1,
        "event_id": uuid.uuid4(),
        "event_type": "order.paid",
        "handler": "hook",
    }
    return Message(payload=payload, **{**defaults, **fields})


def call(handler: WebhookHandler, msg: Message) -> Any:
    async def once() -> Any:
        try:
            return await handler(msg)
        finally:
            await handler.outbox_shutdown()

    return asyncio.run(once())


# -- signing --------------------------------------------------------------------------------


def test_relay_delivery_is_signed_and_verifies_with_the_reference_library(engine, ob, maker, receiver):
    ob.route("order.paid", WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL), name="partner")
    emit_one(maker, "order.paid", {"order_id": 7, "note": "café ☕"})
    drain(ob, engine)

    (req,) = receiver.requests
    assert req.path == "/hook"
    assert req.headers["content-type"] == "application/json"
    assert json.loads(req.body) == {"order_id": 7, "note": "café ☕"}
    assert Webhook(SECRET).verify(req.body, req.headers) == {"order_id": 7, "note": "café ☕"}
    verify(req.body, req.headers, SECRET)
    row = the_message(engine)
    assert row.status == "delivered"
    assert req.headers["webhook-id"] == webhook_id(message({}, event_id=row.event_id, handler="partner"))
    (attempt,) = history(engine)
    assert attempt.outcome == "delivered"
    assert attempt.detail["status"] == 200
    assert attempt.detail["webhook_id"] == req.headers["webhook-id"]


def test_every_secret_signs_so_receivers_can_rotate(receiver):
    handler = WebhookHandler(receiver.url(), [SECRET, OLD_SECRET], allowed_networks=LOCAL)
    call(handler, message({"n": 1}))
    (req,) = receiver.requests
    assert len(req.headers["webhook-signature"].split(" ")) == 2
    for secret in (SECRET, OLD_SECRET):
        Webhook(secret).verify(req.body, req.headers)
        verify(req.body, req.headers, secret)
    verify(req.body, req.headers, [generate_secret(), OLD_SECRET])  # a receiver holding old and next
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(req.body, req.headers, generate_secret())


def test_verify_refuses_tampering_missing_headers_and_stale_or_future_timestamps():
    body = b'{"n":1}'
    now = int(time.time())
    good = {"webhook-id": "msg_1", "webhook-timestamp": str(now), "webhook-signature": ""}
    good["webhook-signature"] = sign([base64.b64decode(SECRET[6:])], "msg_1", now, body)
    verify(body, good, SECRET)
    verify(body, {k.upper(): v for k, v in good.items()}, SECRET)  # header names are case-insensitive
    verify(body, list(good.items()), SECRET)
    received = email.message.Message()  # what http.server hands a receiver: not a Mapping
    for name, value in good.items():
        received[name.title()] = value
    verify(body, received, SECRET)

    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(b'{"n":2}', good, SECRET)
    with pytest.raises(WebhookVerificationError, match="no signature matches"):
        verify(body, {**good, "webhook-id": "msg_2"}, SECRET)
    with pytest.raises(WebhookVerificationError, match="missing header.*webhook-signature"):
        verify(body, {k: v for k, v in good.items() if k != "webhook-signature"}, SECRET)
    with pytest.raises(WebhookVerificationError, match="no v1 signature"):
        verify(body, {**good, "webhook-signature": "v2,abc"}, SECRET)
    for offset, word in ((-400, "old"), (400, "future")):
        stamp = now + offset
        headers = {**good, "webhook-timestamp": str(stamp)}
        headers["webhook-signature"] = sign([base64.b64decode(SECRET[6:])], "msg_1", stamp, body)
        with pytest.raises(WebhookVerificationError, match=word):
            verify(body, headers, SECRET)
        with pytest.raises(ReferenceVerificationError):  # the reference library agrees
            Webhook(SECRET).verify(body, headers)
        verify(body, headers, SECRET, tolerance=600)


@pytest.mark.parametrize(
    "stamp",
    ["²", "١٧٠٠٠٠٠٠٠٠", "9" * 400, "9" * 5000, "1" * 13, "-1", "17e8", ""],
    ids=[
        "superscript",
        "arabic-indic",
        "400-digits",
        "5000-digits",
        "13-digits",
        "negative",
        "float",
        "empty",
    ],
)
def test_any_bad_timestamp_is_a_verification_error_never_a_crash(stamp):
    """A receiver maps WebhookVerificationError to 400; anything else would answer 500."""
    body = b'{"n":1}'
    headers = {"webhook-id": "msg_1", "webhook-timestamp": stamp, "webhook-signature": "v1,AAAA"}
    with pytest.raises(WebhookVerificationError, match="webhook-timestamp|missing header"):
        verify(body, headers, SECRET)


def test_text_that_is_not_utf_8_is_a_verification_error_never_a_crash():
    now = int(time.time())
    good = {"webhook-id": "msg_1", "webhook-timestamp": str(now), "webhook-signature": "v1,AAAA"}
    with pytest.raises(WebhookVerificationError, match="body is not valid UTF-8"):
        verify('{"n":"\ud800"}', good, SECRET)
    with pytest.raises(WebhookVerificationError, match="webhook-id is not valid UTF-8"):
        verify("{}", {**good, "webhook-id": "msg_\udcff"}, SECRET)


@pytest.fixture
def other_receiver() -> Iterator[Receiver]:
    """A second host, as a payload URL might name (still 127.0.0.1, on another port)."""
    yield from serve(Receiver())


def test_configured_headers_reach_only_the_configured_origin_unless_opted_in(receiver, other_receiver):
    token = {"Authorization": "Bearer partner-token-123"}
    with pytest.raises(ConfigurationError, match="headers_to_payload_urls=True") as refused:
        WebhookHandler(secret=SECRET, allowed_networks=LOCAL, headers=token)
    assert "partner-token-123" not in str(refused.value), "header values never appear in errors"
    with pytest.raises(ConfigurationError, match="only with url=None"):
        WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, headers_to_payload_urls=True)

    call(WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, headers=token), message({"n": 1}))
    anywhere = WebhookHandler(secret=SECRET, allowed_networks=LOCAL)
    call(anywhere, message({"url": other_receiver.url(), "n": 2}))
    chosen = WebhookHandler(
        secret=SECRET, allowed_networks=LOCAL, headers=token, headers_to_payload_urls=True
    )
    call(chosen, message({"url": other_receiver.url(), "n": 3}))

    (fixed,) = receiver.requests
    assert fixed.headers["authorization"] == "Bearer partner-token-123"
    unconfigured, opted_in = other_receiver.requests
    assert "authorization" not in unconfigured.headers
    verify(
        unconfigured.body, unconfigured.headers, SECRET
    )  # signed all the same: each host checks the secret
    assert opted_in.headers["authorization"] == "Bearer partner-token-123"


@pytest.mark.parametrize(
    ("secret", "complaint"),
    [
        ("k" * 40, "must start with 'whsec_'"),
        ("whsec_***not-base64***", "not valid base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "decodes to 5 bytes"),
        ([], "at least one"),
        (None, "needs secret="),
    ],
)
def test_bad_secrets_are_configuration_errors_that_never_quote_the_secret(secret, complaint):
    with pytest.raises(ConfigurationError, match=complaint) as raised:
        WebhookHandler("https://hooks.example.test/", secret)
    if isinstance(secret, str):
        assert secret not in str(raised.value) and secret[6:] not in str(raised.value)


def test_bad_configuration_is_refused_at_construction():
    with pytest.raises(ConfigurationError, match="http or https"):
        WebhookHandler("ftp://hooks.example.test/", SECRET)
    with pytest.raises(ConfigurationError, match="credentials"):
        WebhookHandler("https://user:pw@hooks.example.test/", SECRET)
    with pytest.raises(ConfigurationError, match="loopback.*allowed_networks"):
        WebhookHandler("http://127.0.0.1:9/", SECRET)
    with pytest.raises(ConfigurationError, match="CIDR"):
        WebhookHandler("https://hooks.example.test/", SECRET, allowed_networks=["localhost"])
    with pytest.raises(ConfigurationError, match="cannot be overridden"):
        WebhookHandler("https://hooks.example.test/", SECRET, headers={"Webhook-Signature": "x"})
    with pytest.raises(ConfigurationError, match="line breaks"):
        WebhookHandler("https://hooks.example.test/", SECRET, headers={"X-A": "1\r\nX-B: 2"})
    with pytest.raises(ConfigurationError, match="timeout"):
        WebhookHandler("https://hooks.example.test/", SECRET, timeout=0)
    with pytest.raises(ConfigurationError, match="breaker_threshold"):
        WebhookHandler("https://hooks.example.test/", SECRET, breaker_threshold=0)
    with pytest.raises(ConfigurationError, match="rate"):
        WebhookHandler("https://hooks.example.test/", SECRET, rate_limit=-1)


# -- response classes -----------------------------------------------------------------------


def test_503_with_retry_after_is_retried_once_with_the_same_webhook_id(engine, ob, maker, receiver):
    receiver.script = [Reply(503, {"Retry-After": "2"}, b"maintenance")]
    ob.route("order.paid", WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL), name="partner")
    emit_one(maker, "order.paid", {"order_id": 1})
    drain(ob, engine)

    row = the_message(engine)
    assert row.status == "pending" and row.attempts == 1
    (first,) = history(engine)
    assert first.outcome == "retry"
    assert first.detail["status"] == 503 and first.detail["retry_after"] == "2"
    assert first.detail["response"] == "maintenance"
    # The Retry-After, not the millisecond backoff, set the next attempt's time.
    assert 1.5 <= (row.available_at - first.finished_at).total_seconds() <= 2.5

    make_due(engine)
    drain(ob, engine)
    assert the_message(engine).status == "delivered"
    assert [h.outcome for h in history(engine)] == ["retry", "delivered"]
    one, two = receiver.requests
    assert one.headers["webhook-id"] == two.headers["webhook-id"]
    assert one.body == two.body
    for req in (one, two):
        Webhook(SECRET).verify(req.body, req.headers)


def test_retry_after_accepts_seconds_and_http_dates():
    now = time.time()
    assert retry_after("120") == 120
    assert retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert retry_after(formatdate(now - 30, usegmt=True), now=now) == 0
    assert retry_after("10" * 20) == 24 * 3600  # capped
    assert retry_after("soon") is None and retry_after(None) is None and retry_after("nan") is None


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 504])
def test_transient_statuses_retry(receiver, status):
    receiver.default = Reply(status, {"Retry-After": "7"})
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL)
    with pytest.raises(RetryLater) as raised:
        call(handler, message({"n": 1}))
    assert raised.value.delay == 7 and raised.value.counts_as_attempt
    assert raised.value.detail is not None and raised.value.detail["status"] == status


def test_400_goes_dead_with_status_and_a_bounded_excerpt(engine, ob, maker, receiver):
    receiver.default = Reply(400, {"content-type": "text/plain"}, b"field 'amount' is required. " * 500)
    ob.route("order.paid", WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL), name="partner")
    emit_one(maker, "order.paid", {"order_id": 1})
    drain(ob, engine)

    row = the_message(engine)
    assert row.status == "dead" and row.attempts == 1
    (attempt,) = history(engine)
    assert attempt.outcome == "dead"
    assert attempt.detail["status"] == 400
    assert attempt.detail["response"].startswith("field 'amount' is required.")
    assert len(attempt.detail["response"]) == 500
    assert "HTTP 400" in attempt.error
    assert len(receiver.requests) == 1


def test_410_is_dead_and_reported(receiver, caplog):
    receiver.default = Reply(410, body=b"this endpoint was removed")
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL)
    with caplog.at_level(logging.ERROR, logger="outbox.integrations.webhook"):
        with pytest.raises(PermanentError, match="410 Gone") as raised:
            call(handler, message({"n": 1}))
    assert raised.value.detail is not None and raised.value.detail["gone"] is True
    assert [r.action for r in caplog.records] == ["webhook_gone"]


def test_hanging_endpoint_times_out_and_is_retried(engine, ob, maker, receiver):
    receiver.script = [Reply(hang=5.0)]
    handler = WebhookHandler(receiver.url(), SECRET, timeout=0.3, allowed_networks=LOCAL)
    ob.route("order.paid", handler, name="partner", max_attempts=3)
    emit_one(maker, "order.paid", {"order_id": 1})
    started = time.monotonic()
    drain(ob, engine)

    assert time.monotonic() - started < 3
    assert the_message(engine).status == "delivered"
    first, second = history(engine)
    assert first.outcome == "retry" and first.detail["reason"] == "timeout"
    assert "within 0.3s" in first.error
    assert second.outcome == "delivered"


def test_connection_refused_is_transient_and_uses_no_attempt():
    with socket.socket() as sock:  # a port on 127.0.0.1 that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    handler = WebhookHandler(f"http://127.0.0.1:{port}/", SECRET, allowed_networks=LOCAL)
    with pytest.raises(RetryLater, match="cannot connect to 127.0.0.1") as raised:
        call(handler, message({"n": 1}))
    # The receiver is down: that says nothing about the message, so no attempt is used.
    assert raised.value.detail == {"reason": "unreachable", "host": f"127.0.0.1:{port}"}
    assert not raised.value.counts_as_attempt


# -- SSRF guard -----------------------------------------------------------------------------


def test_redirect_to_a_blocked_address_is_refused_not_followed(engine, ob, maker, receiver):
    receiver.default = Reply(302, {"Location": "http://169.254.169.254/latest/meta-data/"})
    ob.route("order.paid", WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL), name="partner")
    emit_one(maker, "order.paid", {"order_id": 1})
    drain(ob, engine)

    assert the_message(engine).status == "dead"
    (attempt,) = history(engine)
    assert attempt.outcome == "dead"
    assert attempt.detail["status"] == 302
    assert attempt.detail["location"] == "http://169.254.169.254/latest/meta-data/"
    assert "redirects are refused" in attempt.error
    assert len(receiver.requests) == 1


def test_loopback_is_refused_unless_allow_listed(engine, ob, maker, receiver):
    ob.route("order.paid", WebhookHandler(secret=SECRET), name="guarded")
    ob.route("order.paid", WebhookHandler(secret=SECRET, allowed_networks=LOCAL), name="allowed")
    payload = {"url": receiver.url("/from-payload"), "order_id": 1}
    with pytest.raises(PayloadError, match="^route 'guarded' refuses .* loopback address \\(SSRF guard\\)"):
        emit_one(maker, "order.paid", payload)
    assert history(engine) == [] and receiver.requests == []
    # A row that never met the emit-time check (an earlier release's, a hand-written one) is
    # refused by the same policy at delivery.
    store_unchecked(engine, "order.paid", payload, "guarded", "allowed")
    drain(ob, engine)

    with engine.connect() as conn:
        status = dict(conn.execute(select(m.c.handler, m.c.status)).all())
    assert status == {"guarded": "dead", "allowed": "delivered"}
    (req,) = receiver.requests  # only the allow-listed route reached the server
    assert req.path == "/from-payload"
    assert json.loads(req.body) == {"url": receiver.url("/from-payload"), "order_id": 1}
    dead = next(h for h in history(engine) if h.outcome == "dead")
    assert "loopback address (SSRF guard)" in dead.error
    assert as_reported(dead.detail) == {
        "reason": "ssrf_refused",
        "host": f"127.0.0.1:{receiver.port}",
        "refused": "loopback",
    }


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "gopher://127.0.0.1/", "http://user:pw@127.0.0.1/", "not a url", None, 42],
)
def test_payload_urls_that_cannot_be_targets_are_permanent(url):
    handler = WebhookHandler(secret=SECRET, allowed_networks=LOCAL)
    with pytest.raises(PermanentError, match="payload\\['url'\\]"):
        call(handler, message({"url": url}))


class FakeDNS:
    """Answers for made-up names, one list of addresses per lookup (the last one repeats)."""

    def __init__(self) -> None:
        self.answers: dict[str, list[list[str]]] = {}
        self.lookups: dict[str, list[list[str]]] = {}


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> FakeDNS:
    dns = FakeDNS()
    real = asyncio.base_events.BaseEventLoop.getaddrinfo

    async def getaddrinfo(self: Any, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in dns.answers:
            return await real(self, host, port, *args, **kwargs)
        queue = dns.answers[host]
        addrs = queue.pop(0) if len(queue) > 1 else queue[0]
        dns.lookups.setdefault(host, []).append(addrs)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port)) for ip in addrs]

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", getaddrinfo)
    return dns


def test_connects_to_the_checked_address_with_the_host_name_in_host(receiver, fake_dns):
    # A rebinding resolver: harmless first answer, metadata address for any later lookup.
    fake_dns.answers["hooks.example.test"] = [["127.0.0.1"], ["169.254.169.254"]]
    handler = WebhookHandler(f"http://hooks.example.test:{receiver.port}/in", SECRET, allowed_networks=LOCAL)
    call(handler, message({"n": 1}))

    (req,) = receiver.requests
    assert req.headers["host"] == f"hooks.example.test:{receiver.port}"
    assert fake_dns.lookups["hooks.example.test"] == [["127.0.0.1"]]  # resolved once, used as checked
    with pytest.raises(PermanentError, match="169.254.169.254.*link-local"):
        call(handler, message({"n": 2}))  # the next attempt resolves afresh and is checked afresh
    assert len(receiver.requests) == 1


def test_https_goes_to_the_checked_address_with_sni_and_verifies_the_host_name(
    tls_receiver, fake_dns, certificate
):
    fake_dns.answers[TLS_NAME] = [["127.0.0.1"]]
    trusted = ssl.create_default_context(cafile=str(certificate[0]))
    url = f"https://{TLS_NAME}:{tls_receiver.port}/secure"
    handler = WebhookHandler(url, SECRET, allowed_networks=LOCAL, ssl_context=trusted)
    assert call(handler, message({"n": 1}))["status"] == 200

    (req,) = tls_receiver.requests
    assert tls_receiver.server_names == [TLS_NAME]  # SNI named the host, not the IP connected to
    assert req.headers["host"] == f"{TLS_NAME}:{tls_receiver.port}"
    Webhook(SECRET).verify(req.body, req.headers)

    # The certificate names TLS_NAME only: the same server reached as 127.0.0.1 fails verification.
    by_ip = WebhookHandler(
        f"https://127.0.0.1:{tls_receiver.port}/", SECRET, allowed_networks=LOCAL, ssl_context=trusted
    )
    with pytest.raises(RetryLater, match="connection to 127.0.0.1.*certificate"):
        call(by_ip, message({"n": 2}))
    untrusted = WebhookHandler(url, SECRET, allowed_networks=LOCAL)  # certifi's CAs: self-signed refused
    with pytest.raises(RetryLater, match="certificate"):
        call(untrusted, message({"n": 3}))
    assert len(tls_receiver.requests) == 1


def test_a_name_with_any_blocked_address_is_refused(receiver, fake_dns):
    fake_dns.answers["mixed.example.test"] = [["127.0.0.1", "10.0.0.7"]]
    handler = WebhookHandler(f"http://mixed.example.test:{receiver.port}/", SECRET, allowed_networks=LOCAL)
    with pytest.raises(PermanentError, match="10.0.0.7.*private"):
        call(handler, message({"n": 1}))
    assert receiver.requests == []


#: (address, why the guard refuses it or None for a public one). Classified only, never connected to.
ADDRESS_CLASSES = [
    ("127.0.0.1", "loopback"),
    ("::1", "loopback"),
    ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"),
    ("192.168.0.1", "private"),
    ("fc00::1", "private"),
    ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("fec0::1", "site-local"),  # deprecated, still routed internally by some networks
    ("feff:ffff::1", "site-local"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    ("ff0e::1", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("0.1.2.3", "private"),  # "this network", 0.0.0.0/8
    ("100.64.0.1", "non-global"),  # shared address space (CGNAT)
    ("100.127.255.254", "non-global"),
    ("198.18.0.1", "private"),  # benchmarking
    ("198.19.255.254", "private"),
    ("192.0.0.9", "private"),  # IETF protocol assignments
    ("192.0.2.1", "private"),  # documentation
    ("2001:db8::1", "private"),  # documentation
    ("3fff::1", "private"),  # documentation (RFC 9637)
    ("3fff:fff:ffff::1", "private"),
    ("3fff:1000::1", None),  # just past 3fff::/20
    ("2001:2::1", "private"),  # benchmarking
    ("100::1", "reserved"),  # discard-only
    ("5f00::1", "reserved"),  # outside 2000::/3
    ("::ffff:10.0.0.1", "private"),  # IPv4-mapped
    ("::ffff:100.64.0.1", "non-global"),
    ("::ffff:93.184.215.14", None),
    ("::a00:1", "private"),  # IPv4-compatible 10.0.0.1
    ("::7f00:1", "loopback"),  # IPv4-compatible 127.0.0.1
    ("::5db8:d70e", "reserved"),  # IPv4-compatible, deprecated even for a public address
    ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
    ("64:ff9b::6440:1", "non-global"),  # NAT64 of 100.64.0.1
    ("64:ff9b::5db8:d70e", None),  # NAT64 of 93.184.215.14
    ("64:ff9b:1::a00:1", "reserved"),  # local-use NAT64 prefix
    ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
    ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
    ("2002:5db8:d70e::1", None),  # 6to4 of 93.184.215.14
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private"),  # Teredo, client 10.0.0.1
    ("2001:0:a00:1:8000:63bf:a247:28f1", "private"),  # Teredo, server 10.0.0.1
    ("2001:0:4136:e378:8000:63bf:a247:28f1", None),  # Teredo, public server and client
    ("93.184.215.14", None),
    ("2606:4700::1111", None),
]


@pytest.mark.parametrize(("address", "reason"), ADDRESS_CLASSES)
def test_address_classes(address, reason):
    assert AddressPolicy().refusal(ipaddress.ip_address(address)) == reason
    if reason is not None:
        net = "::/0" if ":" in address else "0.0.0.0/0"
        assert AddressPolicy([net]).refusal(ipaddress.ip_address(address)) is None


def test_address_classes_do_not_depend_on_the_python_version(monkeypatch):
    """The verdicts come from the guard's own table, not ipaddress's flags, which differ by release.

    Here every flag claims every address is public, as an older table would for
    a range it does not know (3.11 says so of fec0::/10 and 3fff::/20).
    """
    flags = {
        "is_private": False,
        "is_global": True,
        "is_reserved": False,
        "is_loopback": False,
        "is_link_local": False,
        "is_site_local": False,
        "is_multicast": False,
        "is_unspecified": False,
    }
    for cls in (ipaddress.IPv4Address, ipaddress.IPv6Address):
        for flag, value in flags.items():
            if hasattr(cls, flag):
                monkeypatch.setattr(cls, flag, property(lambda self, value=value: value))
    assert not ipaddress.ip_address("10.0.0.1").is_private  # the flags really lie now
    policy = AddressPolicy()
    assert [(a, policy.refusal(ipaddress.ip_address(a))) for a, _ in ADDRESS_CLASSES] == ADDRESS_CLASSES


@pytest.mark.parametrize(
    ("host", "address"),
    [
        ("127.1", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("0x7f.0.0.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("10.1", "10.0.0.1"),
        ("::FFFF:10.0.0.1", "::ffff:10.0.0.1"),
        ("hooks.example.test", None),
        ("cafe.be", None),  # hex digits, but a name
        ("1.2.3.4.5", None),
    ],
)
def test_numeric_shorthands_are_judged_as_the_address_they_reach(host, address):
    """The system resolver reads ``127.1`` or ``2130706433`` as numbers; so does the guard, before DNS."""
    expected = None if address is None else ipaddress.ip_address(address)
    assert literal_address(host) == expected


@pytest.fixture
def outside_connects(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Connections attempted to an address outside 127.0.0.0/8: recorded, and stopped before the real connect.

    A guard that let one through would show here, with no packet sent.
    """
    attempts: list[Any] = []
    loopback = ipaddress.ip_network("127.0.0.0/8")
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def outside(address: Any) -> bool:
        if not isinstance(address, tuple):
            return False  # a Unix socket
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip not in loopback

    def connect(sock: socket.socket, address: Any) -> None:
        if outside(address):
            attempts.append(address)
            raise ConnectionRefusedError(f"the test stops a connection to {address!r}")
        real_connect(sock, address)

    def connect_ex(sock: socket.socket, address: Any) -> int:
        if outside(address):
            attempts.append(address)
            return errno.ECONNREFUSED
        return real_connect_ex(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    return attempts


#: URLs whose host is a refused literal address, with the reason; the guard refuses them without DNS.
REFUSED_URLS = [
    ("http://[fec0::1]/hook", "site-local"),
    ("https://[3fff::1]/hook", "private"),
    ("http://[::ffff:10.0.0.1]:8080/hook", "private"),
    ("http://[::a00:1]/hook", "private"),
    ("http://[2002:a00:1::]/hook", "private"),
    ("http://[64:ff9b::a00:1]/hook", "private"),
    ("http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]/hook", "private"),
    ("http://0.1.2.3/hook", "private"),
    ("http://100.64.0.1/hook", "non-global"),
    ("http://198.18.0.1/hook", "private"),
    ("http://240.0.0.1/hook", "reserved"),
    ("http://224.0.0.1/hook", "multicast"),
    ("http://[ff02::1]/hook", "multicast"),
    ("http://10.1/hook", "private"),
    ("http://0xa9fea9fe/latest/meta-data/", "link-local"),  # 169.254.169.254
]


@pytest.mark.parametrize(("url", "reason"), REFUSED_URLS)
def test_a_refused_literal_address_is_refused_at_construction(url, reason):
    with pytest.raises(ConfigurationError, match=f"{reason} address \\(SSRF guard\\)"):
        WebhookHandler(url, SECRET)


def test_refused_literal_addresses_are_dead_before_any_connection(engine, ob, maker, outside_connects):
    ob.route("order.paid", WebhookHandler(secret=SECRET, allowed_networks=LOCAL), name="guarded")
    for url, reason in REFUSED_URLS:
        with pytest.raises(PayloadError, match=f"{reason} address \\(SSRF guard\\)"):
            emit_one(maker, "order.paid", {"url": url})
        store_unchecked(engine, "order.paid", {"url": url}, "guarded")
    drain(ob, engine)

    with engine.connect() as conn:
        rows = conn.execute(select(m.c.id, m.c.payload, m.c.status, m.c.attempts)).all()
    attempts = {h.message_id: h for h in history(engine)}
    refused = {row.payload["url"]: (row.status, row.attempts, attempts[row.id].detail) for row in rows}
    for url, reason in REFUSED_URLS:
        status, tries, detail = refused[url]
        assert (status, tries) == ("dead", 1), url
        assert detail["reason"] == "ssrf_refused" and detail["refused"] == reason, url
    assert outside_connects == []  # refused on the address alone: no connection was even tried


# -- circuit breaker ------------------------------------------------------------------------


def test_breaker_opens_skips_without_using_attempts_and_closes_after_cooldown(engine, ob, maker, receiver):
    receiver.default = Reply(500, body=b"down")
    handler = WebhookHandler(
        # A cool-down longer than a slow host's drain, so no trial falls due before the drain ends.
        receiver.url(),
        SECRET,
        allowed_networks=LOCAL,
        breaker_threshold=2,
        breaker_cooldown=3.0,
    )
    ob.route("order.paid", handler, name="partner", max_attempts=10)
    emit_one(maker, "order.paid", {"order_id": 1})
    drain(ob, engine)

    host = f"127.0.0.1:{receiver.port}"
    assert len(receiver.requests) == 2  # the breaker opened after two failures; no third request
    assert handler.outbox_breaker_states() == {host: True}
    row = the_message(engine)
    assert row.status == "pending" and row.attempts == 2  # the skip did not use an attempt
    first, second, skip = history(engine)
    assert (first.outcome, second.outcome) == ("retry", "retry")
    assert skip.outcome == "retry" and skip.attempt == 3
    assert skip.detail["breaker"] == "open" and skip.detail["host"] == host
    assert skip.detail["counted"] is False
    # Rescheduled for the end of the breaker's cool-down (what is left of 3 s), not by the backoff;
    # how much is left depends on how soon the skip came, so the attempt's own retry_in is the yardstick.
    wait = skip.detail["retry_in"]
    assert 0 < wait <= 3.0
    assert wait - 0.01 <= (row.available_at - skip.finished_at).total_seconds() <= wait + 0.5

    receiver.default = Reply(200)
    time.sleep(wait + 0.05)  # the message's own due time, which is when the breaker admits its trial
    drain(ob, engine)
    row = the_message(engine)
    assert row.status == "delivered" and row.attempts == 3
    assert history(engine)[-1].outcome == "delivered"
    assert len(receiver.requests) == 3
    assert handler.outbox_breaker_states() == {host: False}


def test_breaker_half_open_admits_one_trial():
    now = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown=10, clock=lambda: now[0])
    for _ in range(2):
        breaker.acquire("h").failure()
    with pytest.raises(CircuitOpen) as raised:
        breaker.acquire("h")
    assert raised.value.remaining == 10
    now[0] = 10.0
    trial = breaker.acquire("h")
    assert trial.trial
    with pytest.raises(CircuitOpen, match="half-open") as waiting:
        breaker.acquire("h")
    # Asked to come back within a second, not when the trial's own cooldown would end.
    assert waiting.value.remaining == 1.0
    trial.failure()  # a failed trial reopens for a full cooldown
    now[0] = 15.0
    with pytest.raises(CircuitOpen):
        breaker.acquire("h")
    now[0] = 20.0
    breaker.acquire("h").success()
    assert breaker.states() == {"h": False}
    assert not breaker.acquire("h").trial
    breaker.acquire("other").release()  # no verdict leaves no trace
    assert "other" not in breaker.states()


def test_while_open_one_caller_volunteers_for_the_next_trial_and_the_others_wait():
    now = [0.0]
    breaker = CircuitBreaker(threshold=1, cooldown=1.0, trial_timeout=10.0, clock=lambda: now[0])
    assert breaker.acquire("h").failure() is True  # open after it
    assert breaker.volunteer("h") and not breaker.volunteer("h")  # one per destination
    now[0] = 1.0
    trial = breaker.acquire("h")
    assert trial.trial and not breaker.volunteer("h")  # a trial is in flight
    with pytest.raises(CircuitOpen, match="half-open"):
        breaker.acquire("h")
    assert trial.failure() is True  # reopened for another cool-down
    assert breaker.volunteer("h")  # the failed trial's caller (or whoever asks first) comes back
    now[0] = 2.0 + VOLUNTEER_GRACE + 0.1  # ... and never came: another may
    assert breaker.volunteer("h")
    # A failed trial that counted (a 500, say) waits longer before the next.
    trial = breaker.acquire("h")
    assert trial.failure(pause=30.0) is True
    with pytest.raises(CircuitOpen) as raised:
        breaker.acquire("h")
    assert raised.value.remaining == 30.0
    now[0] += 30.0
    breaker.acquire("h").success()
    assert not breaker.volunteer("h") and breaker.states() == {"h": False}  # closed: nothing to wait for


def test_behind_an_open_breaker_unavailability_uses_no_attempt_and_an_error_trial_counts(receiver):
    """Outside a relay (no board), nothing parks: deferrals wait out the cool-down instead."""
    receiver.default = Reply(503, body=b"maintenance")
    handler = WebhookHandler(
        receiver.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=2, breaker_cooldown=0.5
    )

    def deferral() -> RetryLater:
        with pytest.raises(RetryLater) as raised:
            call(handler, message({"n": 1}))
        return raised.value

    first = deferral()
    assert first.counts_as_attempt and first.detail["status"] == 503  # the breaker is still closed
    opening = deferral()
    assert not opening.counts_as_attempt and opening.until_recovered is None  # no board: not parked
    assert opening.detail["breaker"] == "open" and opening.detail["status"] == 503
    volunteer = deferral()
    assert not volunteer.counts_as_attempt and volunteer.detail["volunteer"] is True
    assert 0 < volunteer.delay <= 0.5
    waiting = deferral()
    assert not waiting.counts_as_attempt and "volunteer" not in waiting.detail
    assert len(receiver.requests) == 2  # turned away: nothing sent
    time.sleep(volunteer.delay)
    trial = deferral()
    assert trial.detail["trial"] is True and not trial.counts_as_attempt and trial.delay == 0.5
    assert len(receiver.requests) == 3
    receiver.default = Reply(500, body=b"bug")
    time.sleep(0.5)
    errored = deferral()
    assert errored.counts_as_attempt and errored.detail["status"] == 500  # perhaps the message's fault
    assert deferral().delay > 29  # so the next trial comes half a minute later


def test_4xx_does_not_trip_the_breaker(receiver):
    receiver.default = Reply(404)
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, breaker_threshold=1)
    for n in range(3):
        with pytest.raises(PermanentError):
            call(handler, message({"n": n}))
    assert len(receiver.requests) == 3 and handler.outbox_breaker_states() == {}


# -- destinations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spellings", "destination"),
    [
        (
            [
                "https://example.test/hook",
                "https://EXAMPLE.test/hook",
                "https://example.test./hook",
                "https://Example.Test.:443/other",
                "http://example.test:443/",
            ],
            "example.test:443",
        ),
        (["http://example.test/", "http://example.test.:80/", "https://example.test:80/"], "example.test:80"),
        (["https://example.test:8443/", "HTTPS://EXAMPLE.TEST.:8443/"], "example.test:8443"),
        (
            ["https://bücher.example/", "https://BÜCHER.example./", "https://XN--BCHER-KVA.example/"],
            "xn--bcher-kva.example:443",
        ),
        (
            ["http://[2001:DB8:0:0::1]/", "http://[2001:db8::1]:80/", "http://[2001:0db8:0000::0001]/"],
            "[2001:db8::1]:80",
        ),
        (
            [
                "http://127.0.0.1:8080/",
                "http://127.1:8080/",
                "http://2130706433:8080/",
                "http://[::ffff:127.0.0.1]:8080/",
            ],
            "127.0.0.1:8080",
        ),
    ],
    ids=["default-https-port", "default-http-port", "other-port", "idna", "ipv6", "ipv4-spellings"],
)
def test_every_spelling_of_a_destination_has_one_key(spellings, destination):
    """The breaker, rate limit and connection cap key on this; two spellings must not get two of each."""
    assert {parse_target(url).destination for url in spellings} == {destination}


def test_different_destinations_keep_different_keys():
    urls = [
        "https://example.test/",
        "http://example.test/",  # port 80, not 443
        "https://api.example.test/",
        "https://example.test:8443/",
        "https://example.test../",  # one trailing dot goes, not two
        "https://127.0.0.2/",
    ]
    assert len({parse_target(url).destination for url in urls}) == len(urls)


def test_the_host_header_keeps_the_spelling_of_the_url(receiver, fake_dns):
    """Only the key is normalised: the receiver sees the Host its URL names."""
    fake_dns.answers["hooks.example.test."] = [["127.0.0.1"]]
    call(
        WebhookHandler(f"http://HOOKS.example.test.:{receiver.port}/", SECRET, allowed_networks=LOCAL),
        message({}),
    )
    (req,) = receiver.requests
    assert req.headers["host"] == f"hooks.example.test.:{receiver.port}"


def ipv4_spellings(port: int) -> list[str]:
    """127.0.0.1 spelled four ways, each reached without DNS."""
    return [
        f"http://{host}:{port}/hook" for host in ("127.0.0.1", "127.1", "[::ffff:127.0.0.1]", "2130706433")
    ]


def name_spellings(port: int, fake_dns: FakeDNS) -> list[str]:
    """One made-up name spelled three ways (case, a trailing dot), each answered 127.0.0.1."""
    for name in ("hooks.example.test", "hooks.example.test."):
        fake_dns.answers[name] = [["127.0.0.1"]]
    return [
        f"http://{host}:{port}/hook"
        for host in ("hooks.example.test", "HOOKS.example.test.", "Hooks.Example.Test")
    ]


def test_spellings_of_one_destination_share_its_breaker(receiver, fake_dns):
    receiver.default = Reply(500, body=b"down")
    for urls, destination in (
        (ipv4_spellings(receiver.port), f"127.0.0.1:{receiver.port}"),
        (name_spellings(receiver.port, fake_dns), f"hooks.example.test:{receiver.port}"),
    ):
        receiver.requests.clear()
        *failing, skipped = urls
        handler = WebhookHandler(secret=SECRET, allowed_networks=LOCAL, breaker_threshold=len(failing))
        for url in failing:  # one failure per spelling: together they reach the threshold
            with pytest.raises(RetryLater) as raised:
                call(handler, message({"url": url}))
            assert raised.value.detail is not None and raised.value.detail["status"] == 500
        with pytest.raises(
            RetryLater, match=f"circuit breaker for {re.escape(destination)} is open"
        ) as raised:
            call(handler, message({"url": skipped}))
        assert not raised.value.counts_as_attempt
        assert raised.value.detail is not None and raised.value.detail["destination"] == destination
        assert len(receiver.requests) == len(failing)  # the last spelling sent nothing
        assert handler.outbox_breaker_states() == {destination: True}


@pytest.mark.parametrize("kind", ["ipv4", "names"])
def test_spellings_of_one_destination_share_its_rate_limit(receiver, fake_dns, kind):
    spelled = {"ipv4": ipv4_spellings(receiver.port), "names": name_spellings(receiver.port, fake_dns)}
    first, second, *_ = spelled[kind]
    # One request per 5 s: the second spelling finds the slot the first one took.
    handler = WebhookHandler(secret=SECRET, allowed_networks=LOCAL, rate_limit=0.2, timeout=2.0)
    call(handler, message({"url": first}))
    with pytest.raises(RetryLater, match="rate limit") as raised:
        call(handler, message({"url": second}))
    assert not raised.value.counts_as_attempt
    assert raised.value.detail is not None and raised.value.detail["rate_limit"] == "deferred"
    assert len(receiver.requests) == 1


# -- concurrency ----------------------------------------------------------------------------


def test_a_relay_keeps_more_than_100_requests_open_to_one_host(engine, ob, maker, receiver):
    """The relay's concurrency, not httpx's default pool of 100, bounds the requests to one receiver.

    Each request is answered only once 150 are open at the same time; a pool
    that stopped at 100 connections would leave them all waiting until the
    receiver gives up and answers 503.
    """
    together = threading.Barrier(150, timeout=10)

    def all_at_once(req: Received) -> Reply:
        try:
            together.wait()
        except threading.BrokenBarrierError:
            return Reply(status=503)
        return Reply()

    receiver.default = all_at_once
    ob.route(
        "order.paid",
        WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, timeout=30),
        name="partner",
    )
    with maker() as s, s.begin():
        for n in range(150):
            emit(s, "order.paid", {"n": n})
    Relay(ob, engine, concurrency=150).run_until_idle()

    assert len(receiver.requests) == 150
    with engine.connect() as conn:
        assert conn.execute(select(m.c.status, m.c.attempts).distinct()).all() == [("delivered", 1)]


# -- rate limit -----------------------------------------------------------------------------


def test_rate_limit_is_shared_by_concurrent_deliveries(receiver):
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, rate_limit=20)

    async def burst() -> None:
        try:
            await asyncio.gather(*(handler(message({"n": n}, id=n)) for n in range(5)))
        finally:
            await handler.outbox_shutdown()

    asyncio.run(burst())
    times = sorted(r.at for r in receiver.requests)
    assert len(times) == 5
    # Five requests at 20/s are released over 0.2 s; the first one's connection set-up can eat into
    # the span the server sees, so only half of it is required (still far above an unlimited burst).
    assert times[-1] - times[0] >= 0.1


def test_a_long_rate_wait_is_rescheduled_without_using_an_attempt(receiver):
    # One request per 5 s, and a wait longer than the 2 s timeout is deferred: the first request has
    # 2 s to be answered on a loaded host, and the second still finds more than 2 s to wait.
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL, rate_limit=0.2, timeout=2.0)
    call(handler, message({"n": 1}))
    with pytest.raises(RetryLater) as raised:
        call(handler, message({"n": 2}))
    assert not raised.value.counts_as_attempt
    assert raised.value.detail is not None and raised.value.detail["rate_limit"] == "deferred"
    assert 2.0 < (raised.value.delay or 0) <= 5.0
    assert len(receiver.requests) == 1


def test_rate_limiter_serves_threads_and_loops_alike():
    limiter = RateLimiter(50, burst=2)
    stamps: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        limiter.acquire_sync()
        with lock:
            stamps.append(time.monotonic())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    asyncio.run(limiter.acquire())
    stamps.append(time.monotonic())
    stamps.sort()
    assert stamps[-1] - stamps[0] >= 3 / 50 - 0.01  # two free, then one every 20 ms
    now = [100.0]
    strict = RateLimiter(1, clock=lambda: now[0])
    strict.acquire_sync()
    with pytest.raises(RateLimited) as raised:
        strict.acquire_sync(max_wait=0.5)
    assert raised.value.wait == 1.0
    now[0] = 101.0
    strict.acquire_sync(max_wait=0)  # the refusal reserved nothing, so the slot at 101 is free


# -- secrets stay secret --------------------------------------------------------------------


def test_secrets_never_reach_history_rows_or_logs(engine, ob, maker, receiver, caplog):
    token = "Bearer tok-" + uuid.uuid4().hex

    def echo(req: Received) -> Reply:  # a careless receiver quoting what it was sent, and the secret
        return Reply(500, body=f"bad auth {req.headers.get('authorization')} for {SECRET}".encode())

    receiver.script = [echo, echo]
    receiver.default = Reply(400, body=f"still no: {SECRET[6:]}".encode())
    handler = WebhookHandler(
        receiver.url(), [SECRET, OLD_SECRET], allowed_networks=LOCAL, headers={"Authorization": token}
    )
    ob.route("order.paid", handler, name="partner", max_attempts=5)
    emit_one(maker, "order.paid", {"order_id": 1})
    with caplog.at_level(logging.DEBUG):
        drain(ob, engine)

    assert receiver.requests[0].headers["authorization"] == token
    assert [h.outcome for h in history(engine)] == ["retry", "retry", "dead"]
    with engine.connect() as conn:
        stored = repr(conn.execute(select(m)).all()) + repr(conn.execute(select(a)).all())
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "***" in stored
    for text in (stored, logged):
        for secret in (SECRET, SECRET[6:], OLD_SECRET[6:], token, token[7:]):
            assert secret not in text


def test_clients_are_closed_when_the_relay_stops(engine, ob, maker, receiver):
    handler = WebhookHandler(receiver.url(), SECRET, allowed_networks=LOCAL)
    ob.route("order.paid", handler, name="partner")
    emit_one(maker, "order.paid", {"order_id": 1})
    drain(ob, engine)
    emit_one(maker, "order.paid", {"order_id": 2})
    drain(ob, engine)  # a second run_until_idle: a new event loop, new clients
    assert len(receiver.requests) == 2
    assert len(handler._pools) == 0
