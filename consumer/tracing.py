"""The consumer's OpenTelemetry span: one ``process {event_type}`` span per delivery, continuing its trace.

A message from our publishers carries the emitting request's trace context
(``traceparent``), and the inbox's work is the next step of that same story,
so the span is its child (kind CONSUMER): the trace reads request → relay →
broker → consumer. The span is current in the worker thread while the
handlers run, so an ``emit()`` inside a handler stores this span's context and
the chain goes on to the next consumer. An ``Inbox(outbox=...)`` whose Outbox
has a ``tracer_provider`` gets its spans from that provider, as the relay
does. Without an SDK the span records nothing but still carries the incoming
context onward; without the ``[otel]`` extra nothing here runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from outbox import InboxMessage, Processed, __version__
from outbox._tracing import api, extract

__all__ = ["traced"]

_INSTRUMENTATION = "sqlalchemy-outbox"
T = TypeVar("T")


@contextmanager
def _span(inbox: str, system: str, message: InboxMessage, provider: Any) -> Iterator[Any]:
    otel = api()
    if otel is None:
        yield None
        return
    parent = (extract(message.headers) if message.headers else None) or otel.Context()
    tracer = (
        provider.get_tracer(_INSTRUMENTATION, __version__)
        if provider is not None
        else otel.get_tracer(_INSTRUMENTATION, __version__)
    )
    attributes: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.message.id": message.id,
        "messaging.destination.name": message.source or "",
        "outbox.inbox": inbox,
        "outbox.event_type": message.event_type,
        "outbox.attempt": message.attempt,
    }
    span = tracer.start_span(
        f"process {message.event_type}", context=parent, kind=otel.SpanKind.CONSUMER, attributes=attributes
    )
    if not span.is_recording() and not span.get_span_context().is_valid:
        span.end()
        yield None
        return
    token = otel.attach(otel.set_span_in_context(span, parent))
    try:
        yield span
    except BaseException as error:
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(otel.Status(otel.StatusCode.ERROR, type(error).__qualname__))
        raise
    finally:
        otel.detach(token)
        span.end()


def traced(
    inbox: str, system: str, message: InboxMessage, work: Callable[[], Processed], provider: Any = None
) -> Processed:
    """Run ``work`` (the message's transaction, in a worker thread) inside the message's span.

    ``provider`` is the inbox's Outbox's ``tracer_provider`` when it has one,
    as for the relay's spans; else the global provider.
    """
    with _span(inbox, system, message, provider) as span:
        result = work()
        if span is not None:
            span.set_attribute("outbox.outcome", result.outcome)
        return result
