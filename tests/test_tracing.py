"""OpenTelemetry from emit() to delivery, through the real relay on SQLite and PostgreSQL.

Spans are recorded by opentelemetry-sdk's in-memory exporter on a provider of
each test's own, handed to the Outbox (``tracer_provider=``), so no test
touches the global provider. No instrumentation library is installed: what
proves that the attempt's span is current while a handler runs is the handler
reading ``trace.get_current_span()`` itself, and the webhook's ``traceparent``.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

import outbox
from outbox import Backoff, ConfigurationError, Message, Outbox, emit
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay

m = outbox.outbox_message
FAST = Backoff(base=0.001, cap=0.002)
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Traces:
    provider: TracerProvider
    exporter: InMemorySpanExporter

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]

    def request(self) -> Any:
        """The application's own span around the emitting transaction."""
        return self.provider.get_tracer("app").start_as_current_span("request", kind=SpanKind.SERVER)


@pytest.fixture
def traces() -> Iterator[Traces]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Traces(provider, exporter)
    provider.shutdown()


def outbox_for(traces: Traces, **options: Any) -> Outbox:
    return Outbox(default_backoff=FAST, tracer_provider=traces.provider, **options)


def install(ob: Outbox, engine: Engine) -> sessionmaker[Session]:
    factory = sessionmaker(engine)
    ob.install(factory)
    return factory


def deliver_all(ob: Outbox, engine: Engine) -> None:
    """Run the relay until nothing is pending or running (millisecond backoffs fall due as we loop)."""
    for _ in range(200):
        Relay(ob, engine).run_until_idle()
        with engine.connect() as conn:
            left = conn.execute(select(m.c.id).where(m.c.status.in_(["pending", "running"]))).all()
        if not left:
            return
        time.sleep(0.005)
    raise AssertionError("messages were left undelivered")


def stored_headers(engine: Engine) -> dict[uuid.UUID, dict[str, str]]:
    with engine.connect() as conn:
        return {
            uuid.UUID(str(r.event_id)): r.headers for r in conn.execute(select(m.c.event_id, m.c.headers))
        }


def traceparent(span_context: Any) -> str:
    """The W3C header for a span context (flags as the SDK sets them: sampled, and random ids)."""
    flags = int(span_context.trace_flags)
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"


def seen_by_handler() -> tuple[int, int, bool]:
    """What a handler sees as its current span: (trace id, span id, recording)."""
    span = trace.get_current_span()
    ctx = span.get_span_context()
    return ctx.trace_id, ctx.span_id, span.is_recording()


# -- link (default) and child -----------------------------------------------------------------


def test_two_events_give_two_process_spans_linked_to_the_request_span(engine, traces):
    ob = outbox_for(traces)
    seen: dict[int, tuple[int, int, bool]] = {}

    def record(message: Message) -> None:  # a plain function: runs in a worker thread
        seen[message.id] = seen_by_handler()

    ob.route("order.paid", record, name="record", queue="mail")
    factory = install(ob, engine)
    with traces.request() as request, factory() as s, s.begin():
        first = emit(s, "order.paid", {"n": 1}, group_key="order-1")
        second = emit(s, "order.paid", {"n": 2})
    deliver_all(ob, engine)

    req = request.get_span_context()
    headers = stored_headers(engine)
    for event_id in (first, second):  # stored in the emitting transaction
        assert headers[event_id]["traceparent"] == traceparent(req)
    spans = traces.named("process record")
    assert len(spans) == 2
    by_event = {s.attributes["messaging.message.id"]: s for s in spans}
    assert set(by_event) == {str(first), str(second)}
    for span in spans:
        assert span.kind is SpanKind.CONSUMER
        assert span.parent is None and span.context.trace_id != req.trace_id  # a trace of its own...
        (link,) = span.links  # ... linked to the span that emitted it
        assert (link.context.trace_id, link.context.span_id) == (req.trace_id, req.span_id)
        assert span.attributes["messaging.system"] == "sqlalchemy-outbox"
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.destination.name"] == "mail"
        assert span.attributes["outbox.attempt"] == 1
        assert span.attributes["outbox.handler"] == "record"
        assert span.attributes["outbox.outcome"] == "delivered"
        assert "error.type" not in span.attributes
        assert span.status.status_code is StatusCode.UNSET
        # current in the handler's thread: the handler saw this very span, recording
        row_id = span.attributes["outbox.message.row_id"]
        assert seen[row_id] == (span.context.trace_id, span.context.span_id, True)
    assert by_event[str(first)].attributes["messaging.message.conversation_id"] == "order-1"
    assert "messaging.message.conversation_id" not in by_event[str(second)].attributes
    claims = traces.named("claim mail")
    assert sum(c.attributes["messaging.batch.message_count"] for c in claims) == 2
    assert all(c.attributes["messaging.operation.type"] == "receive" for c in claims)


def test_trace_parent_child_makes_deliveries_children_in_the_request_trace(engine, traces):
    ob = outbox_for(traces, trace_parent="child")
    ob.route("order.paid", lambda message: None, name="ship")
    factory = install(ob, engine)
    with traces.request() as request, factory() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
        emit(s, "order.paid", {"n": 2})
    deliver_all(ob, engine)

    req = request.get_span_context()
    spans = traces.named("process ship")
    assert len(spans) == 2
    for span in spans:
        assert span.context.trace_id == req.trace_id
        assert span.parent is not None and span.parent.span_id == req.span_id
        assert not span.links


def test_a_failing_handler_records_error_type_a_retry_then_dead(engine, traces):
    ob = outbox_for(traces)

    def broken(message: Message) -> None:
        raise ValueError(f"no stock for attempt {message.attempt}")

    ob.route("order.paid", broken, name="broken", max_attempts=2)
    factory = install(ob, engine)
    with traces.request() as request, factory() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    deliver_all(ob, engine)

    spans = sorted(traces.named("process broken"), key=lambda s: s.attributes["outbox.attempt"])
    assert [s.attributes["outbox.attempt"] for s in spans] == [1, 2]
    for span in spans:
        assert span.attributes["error.type"] == "ValueError"
        assert span.status.status_code is StatusCode.ERROR
        assert span.links[0].context.span_id == request.get_span_context().span_id
    first, last = spans
    (retry,) = first.events
    assert retry.name == "outbox.retry"
    assert 0 <= retry.attributes["outbox.retry.delay"] <= 0.002
    assert retry.attributes["outbox.retry.counted"] is True
    (dead,) = last.events
    assert dead.name == "outbox.dead"
    assert dead.attributes["outbox.dead.reason"] == "no stock for attempt 2"
    assert dead.attributes["outbox.dead.exhausted"] is True
    assert last.attributes["outbox.outcome"] == "dead"


# -- what emit() stores ---------------------------------------------------------------------------


def test_a_traceparent_the_caller_set_wins(engine, traces):
    ob = outbox_for(traces)
    ob.route("order.paid", lambda message: None, name="ship")
    factory = install(ob, engine)
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with traces.request(), factory() as s, s.begin():
        event_id = emit(s, "order.paid", {"n": 1}, headers={"traceparent": theirs, "x-tenant": "t1"})
    assert stored_headers(engine)[event_id] == {"traceparent": theirs, "x-tenant": "t1"}
    deliver_all(ob, engine)
    (span,) = traces.named("process ship")
    (link,) = span.links
    assert (link.context.trace_id, link.context.span_id) == (
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
    )


def test_nothing_is_stored_without_a_current_span_or_with_trace_context_off(engine, traces):
    ob = outbox_for(traces)
    ob.route("order.paid", lambda message: None, name="ship")
    factory = install(ob, engine)
    with factory() as s, s.begin():
        untraced = emit(s, "order.paid", {"n": 1})
    ob.trace_context = False
    with traces.request(), factory() as s, s.begin():
        switched_off = emit(s, "order.paid", {"n": 2})
    headers = stored_headers(engine)
    assert headers[untraced] == {} and headers[switched_off] == {}


def test_baggage_is_stored_only_when_enabled(engine, traces):
    quiet, chatty = outbox_for(traces), outbox_for(traces, trace_baggage=True)
    quiet.route("order.paid", lambda message: None, name="quiet")
    chatty.route("user.seen", lambda message: None, name="chatty")
    quiet_factory, chatty_factory = install(quiet, engine), install(chatty, engine)
    token = context.attach(baggage.set_baggage("tenant", "acme"))
    try:
        with traces.request():
            with quiet_factory() as s, s.begin():
                left_out = emit(s, "order.paid", {"n": 1})
            with chatty_factory() as s, s.begin():
                kept = emit(s, "user.seen", {"n": 2})
    finally:
        context.detach(token)
    headers = stored_headers(engine)
    assert set(headers[left_out]) == {"traceparent"}
    assert headers[kept]["baggage"] == "tenant=acme" and "traceparent" in headers[kept]


# -- the span is current in handlers --------------------------------------------------------------


class AsyncPublisher:
    """An async handler that says it publishes to a broker, as the broker publishers will."""

    outbox_messaging_system = "rabbitmq"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bool]] = []

    async def __call__(self, message: Message) -> None:
        self.seen.append(seen_by_handler())


def test_the_attempt_span_is_current_in_sync_and_async_handlers(engine, traces):
    ob = outbox_for(traces, trace_parent="child")
    in_thread: list[tuple[int, int, bool]] = []
    publisher = AsyncPublisher()
    ob.route("order.paid", lambda message: in_thread.append(seen_by_handler()), name="sync_one")
    ob.route("order.paid", publisher, name="async_one")
    factory = install(ob, engine)
    with traces.request(), factory() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    deliver_all(ob, engine)

    (sync_span,) = traces.named("process sync_one")
    (async_span,) = traces.named("process async_one")
    assert in_thread == [(sync_span.context.trace_id, sync_span.context.span_id, True)]
    assert publisher.seen == [(async_span.context.trace_id, async_span.context.span_id, True)]
    assert sync_span.attributes["messaging.system"] == "sqlalchemy-outbox"
    assert async_span.attributes["messaging.system"] == "rabbitmq"


# -- webhooks -------------------------------------------------------------------------------------


@dataclass
class Hooks:
    """A plain HTTP receiver on 127.0.0.1: every request's path and headers (every value), answered 200."""

    requests: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    port: int = 0


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    seen = Hooks()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            received: dict[str, list[str]] = {}
            for name, value in self.headers.items():
                received.setdefault(name.lower(), []).append(value)
            seen.requests[self.path] = received
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    seen.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield seen
    server.shutdown()
    server.server_close()


def test_webhooks_send_traceparent_only_when_opted_in(engine, traces, hooks):
    ob = outbox_for(traces)
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    url = f"http://127.0.0.1:{hooks.port}"
    local = ["127.0.0.0/8"]
    traced = WebhookHandler(f"{url}/traced", secret, allowed_networks=local, send_trace_context=True)
    ob.route("order.paid", traced, name="traced_hook")
    ob.route("order.paid", WebhookHandler(f"{url}/plain", secret, allowed_networks=local), name="plain_hook")
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    fixed = WebhookHandler(
        f"{url}/fixed",
        secret,
        allowed_networks=local,
        headers={"Traceparent": theirs},
        send_trace_context=True,
    )
    ob.route("order.paid", fixed, name="fixed_hook")
    factory = install(ob, engine)
    with traces.request(), factory() as s, s.begin():
        emit(s, "order.paid", {"n": 1})
    deliver_all(ob, engine)

    (span,) = traces.named("process traced_hook")
    sent = hooks.requests["/traced"]
    assert sent["traceparent"] == [traceparent(span.context)]
    assert "baggage" not in sent
    assert not {"traceparent", "tracestate"} & set(hooks.requests["/plain"])
    assert hooks.requests["/fixed"]["traceparent"] == [theirs]  # configured: sent as given, and alone


def test_tracing_options_are_checked():
    with pytest.raises(ConfigurationError, match="trace_parent"):
        Outbox(trace_parent="sibling")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="trace_baggage"):
        Outbox(trace_baggage="yes")  # type: ignore[arg-type]
    secret = "whsec_" + base64.b64encode(b"k" * 32).decode()
    with pytest.raises(ConfigurationError, match="send_trace_context"):
        WebhookHandler("https://hooks.example.com/", secret, send_trace_context=1)  # type: ignore[arg-type]


# -- without the extra ----------------------------------------------------------------------------

_WITHOUT_OTEL = """
import sys

class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"blocked for this test: {name}")
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
for name in [n for n in sys.modules if n.startswith("opentelemetry")]:
    del sys.modules[name]

import outbox
from outbox import Outbox, emit
from outbox._tracing import current_headers
from outbox.integrations.webhook import WebhookHandler
from outbox.relay import Relay
from sqlalchemy import create_engine, select
from sqlalchemy.orm import sessionmaker

url = "sqlite:///" + sys.argv[1]
outbox.upgrade(url)
engine = create_engine(url)
delivered = []
ob = Outbox(trace_parent="child", trace_baggage=True)
ob.route("order.paid", lambda message: delivered.append(message.payload), name="ship")
factory = sessionmaker(engine)
ob.install(factory)
with factory() as s, s.begin():
    emit(s, "order.paid", {"n": 1}, headers={"x-tenant": "t1"})
result = Relay(ob, engine).run_until_idle()
assert result.delivered == 1 and delivered == [{"n": 1}], (result, delivered)
with engine.connect() as conn:
    assert conn.execute(select(outbox.outbox_message.c.headers)).scalar_one() == {"x-tenant": "t1"}
assert current_headers() == {}
WebhookHandler("https://hooks.example.com/", "whsec_" + "a" * 44, send_trace_context=True)  # valid base64
assert not [n for n in sys.modules if n.startswith("opentelemetry")], "opentelemetry was imported"
print("ok")
"""


def _script_says_ok(script: str, tmp_path: Path) -> None:
    """Run ``script`` in a Python of its own (global state: imports, the tracer provider)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), str(tmp_path / "outbox.db")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_without_opentelemetry_emit_and_delivery_work_and_nothing_is_imported(tmp_path):
    _script_says_ok(_WITHOUT_OTEL, tmp_path)


def test_importing_the_package_does_not_load_opentelemetry():
    code = (
        "import sys, outbox, outbox.relay, outbox.integrations.webhook; "
        "assert not [n for n in sys.modules if n.startswith('opentelemetry')]"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


_GLOBAL_PROVIDER_LATER = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import Outbox, emit
from outbox.relay import Relay

url = "sqlite:///" + sys.argv[1]
outbox.upgrade(url)
engine = create_engine(url)
seen = []
ob = Outbox()  # no tracer_provider: the relay uses the global one, whenever it is set
ob.route("order.paid", lambda message: seen.append(trace.get_current_span().is_recording()), name="ship")
factory = sessionmaker(engine)
ob.install(factory)
relay = Relay(ob, engine)

def deliver(n):
    with factory() as s, s.begin():
        emit(s, "order.paid", {"n": n})
    assert relay.run_until_idle().delivered == 1

deliver(1)  # the API without an SDK: nothing records
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
deliver(2)  # the same relay, once the application has set its provider
names = sorted(s.name for s in exporter.get_finished_spans())
assert seen == [False, True], seen
assert names == ["claim default", "process ship"], names
print("ok")
"""


def test_a_global_provider_set_after_the_relay_started_gets_the_spans(tmp_path):
    _script_says_ok(_GLOBAL_PROVIDER_LATER, tmp_path)  # the global provider can be set once per process
