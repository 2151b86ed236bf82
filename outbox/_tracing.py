"""OpenTelemetry when it is installed (the ``[otel]`` extra), nothing at all when it is not.

This is the only module that imports ``opentelemetry``, and only on first use:
an application without the extra never pays for more than one attribute
check per ``emit()``, and importing ``outbox`` never loads the API even when
it is installed. Everything here goes through the global propagator
(``opentelemetry.propagate``), so W3C trace context is used by default and a
propagator the application configures (B3, say) is honoured.

The relay's spans (``outbox.relay.tracing``) and the webhook's outgoing
headers use the same loaded API, through :func:`api`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context

__all__ = ["TRACE_HEADERS", "Api", "api", "current_headers", "emit_headers", "extract"]

#: Headers the W3C propagator writes; a caller who sets ``traceparent`` keeps both of these untouched.
TRACE_HEADERS = ("traceparent", "tracestate")
_BAGGAGE = "baggage"


class Api:
    """The parts of ``opentelemetry-api`` the outbox uses, looked up once."""

    __slots__ = (
        "Context",
        "Link",
        "SpanKind",
        "Status",
        "StatusCode",
        "attach",
        "clear_baggage",
        "detach",
        "extract",
        "get_all_baggage",
        "get_current_span",
        "get_tracer",
        "get_tracer_provider",
        "inject",
        "set_span_in_context",
        "unrecording_providers",
    )

    def __init__(self) -> None:
        from opentelemetry import baggage, context, propagate, trace

        self.Context = context.Context
        self.attach = context.attach
        self.detach = context.detach
        self.get_current_span = trace.get_current_span
        self.set_span_in_context = trace.set_span_in_context
        self.get_tracer = trace.get_tracer
        self.get_tracer_provider = trace.get_tracer_provider
        #: The global provider before an SDK is set (the proxy), or one set to record nothing.
        self.unrecording_providers = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self.Link = trace.Link
        self.SpanKind = trace.SpanKind
        self.Status = trace.Status
        self.StatusCode = trace.StatusCode
        self.inject = propagate.inject
        self.extract = propagate.extract
        self.get_all_baggage = baggage.get_all
        self.clear_baggage = baggage.clear


_NOT_LOADED: Any = object()
_api: Api | None = _NOT_LOADED


def api() -> Api | None:
    """The loaded API, or None without the ``[otel]`` extra; the import is tried once."""
    global _api
    if _api is _NOT_LOADED:
        try:
            _api = Api()
        except ImportError:
            _api = None
    return _api


def emit_headers(headers: dict[str, str], *, baggage: bool) -> dict[str, str]:
    """``headers`` plus the current trace context, for an emitted event's row.

    Nothing is injected (and ``headers`` is returned as is) when there is no
    valid current span: the common untraced request costs one lookup. A
    ``traceparent`` the caller set wins, and then nothing of the current
    context is added. Baggage is user data that would be stored in the database
    and copied to every handler, so it is left out unless ``baggage`` is True.
    The propagator is looked up on each call (a global read): an application
    may configure its own after the first emit.
    """
    otel = _api if _api is not _NOT_LOADED else api()
    if otel is None or not otel.get_current_span().get_span_context().is_valid:
        return headers
    if headers and any(name.lower() == "traceparent" for name in headers):
        return headers
    context = None
    if not baggage and otel.get_all_baggage():
        context = otel.clear_baggage()  # propagators other than W3C's carry baggage too
    carrier: dict[str, str] = {}
    otel.inject(carrier, context)
    if not carrier:
        return headers
    taken = {name.lower() for name in headers}
    return {**headers, **{k: v for k, v in carrier.items() if k.lower() not in taken}}


def extract(headers: Mapping[str, str]) -> Context | None:
    """The context an emitted event carried, or None (no API, or nothing stored)."""
    otel = api()
    if otel is None or not headers:
        return None
    return otel.extract(headers)


def current_headers() -> dict[str, str]:
    """The current span's trace context as outgoing request headers, baggage left out.

    For handlers whose user opted in to sending trace context to a third party
    (``WebhookHandler(send_trace_context=True)``): the receiver learns trace
    and span ids, nothing the application put in baggage.
    """
    otel = api()
    if otel is None or not otel.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    otel.inject(carrier, otel.clear_baggage() if otel.get_all_baggage() else None)
    carrier.pop(_BAGGAGE, None)
    return carrier
