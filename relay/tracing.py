"""The relay's OpenTelemetry spans: one per attempt, one per claim round that claimed something.

Every attempt gets a ``process {handler}`` span (kind CONSUMER) carrying the
messaging semantic conventions. It is current while the handler runs: on the
loop for ``async def`` handlers, and in the worker thread for plain functions
(``dispatch`` runs them in a copy of the delivery task's context), so HTTP,
SMTP or broker instrumentation nests under it. It is linked to the span that
emitted the event (the trace context ``emit()`` stored in the headers), or is
its child with ``Outbox(trace_parent="child")``: a link by default, because
deliveries can come minutes or days later, and retries, in one trace would
stretch the request's trace far past the request. The attempts of a batch
handed to its handler at once (``batch.py``) each get theirs too, none of them
current: the one call is no single message's child.

Retries and dead letters are events on the attempt's span (``outbox.retry``,
``outbox.dead``), recorded when the attempt's outcome is decided.

A claim round that claimed nothing makes no span: a polling relay would
otherwise send one per queue per poll interval. A claim that did gets a
``claim {queue}`` span, made after the fact with the claim's own start time.

Without the ``[otel]`` extra (or with no SDK configured and no context to pass
on) every method here returns at once and nothing is made.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from outbox import Outbox, Route, __version__
from outbox._tracing import Api, api, extract

from .outcomes import Completion

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["RelayTracing"]

SYSTEM = "sqlalchemy-outbox"
_INSTRUMENTATION = "sqlalchemy-outbox"


def _system_of(route: Route) -> str:
    """``messaging.system``: the broker's name when the handler publishes to one."""
    system = getattr(route.handler, "outbox_messaging_system", None)
    return system if isinstance(system, str) and system else SYSTEM


class _Untraced:
    """What :meth:`RelayTracing.process` returns when nothing is traced: does nothing, cheaply."""

    __slots__ = ()

    def __enter__(self) -> _Untraced:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def outcome(self, completion: Completion) -> None:
        return None


_UNTRACED = _Untraced()


class _Attempt:
    """One attempt's span, current (attached) between enter and exit unless told not to, ended at exit."""

    __slots__ = ("_current", "_otel", "_span", "_token")

    def __init__(self, otel: Api, span: Span, current: bool) -> None:
        self._otel = otel
        self._span = span
        self._current = current
        self._token: Any = None

    def __enter__(self) -> _Attempt:
        if self._current:
            self._token = self._otel.attach(self._otel.set_span_in_context(self._span))
        return self

    def outcome(self, completion: Completion) -> None:
        """Record what the attempt came to: error.type and ERROR status, and a retry or dead event."""
        span = self._span
        span.set_attribute("outbox.outcome", completion.outcome)
        if completion.status == "delivered":
            return
        error_type = completion.error_type or completion.outcome
        span.set_attribute("error.type", error_type)
        span.set_status(self._otel.Status(self._otel.StatusCode.ERROR, completion.error))
        if completion.status == "pending":
            span.add_event(
                "outbox.retry",
                {
                    "outbox.retry.delay": completion.retry_in,
                    "outbox.retry.counted": not completion.refund,
                },
            )
        else:
            exhausted = bool(completion.detail and completion.detail.get("exhausted"))
            span.add_event(
                "outbox.dead",
                {
                    "outbox.dead.reason": completion.error or error_type,
                    "outbox.dead.exhausted": exhausted,
                    "error.type": error_type,
                },
            )

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._token is not None:
            self._otel.detach(self._token)
        if kind is not None:  # cancelled (a forced stop), or a relay error: the claimer records it
            self._span.set_attribute("error.type", kind.__qualname__)
            self._span.set_status(self._otel.Status(self._otel.StatusCode.ERROR, kind.__qualname__))
        self._span.end()


class RelayTracing:
    """Spans for one relay run; made once per run, from the Outbox's tracing settings."""

    def __init__(self, outbox: Outbox, routes: Mapping[str, Route]) -> None:
        self._otel = api()
        self._tracer: Tracer | None = None
        if self._otel is not None:
            provider = outbox.tracer_provider
            self._tracer = (
                provider.get_tracer(_INSTRUMENTATION, __version__)
                if provider is not None
                else self._otel.get_tracer(_INSTRUMENTATION, __version__)
            )
        self._child = outbox.trace_parent == "child"
        self._global = self._otel is not None and outbox.tracer_provider is None
        self._unrecorded = False  # until the first claim looks
        self._systems = {name: _system_of(route) for name, route in routes.items()}

    def _look_at_the_provider(self) -> None:
        """Note whether an SDK is behind the global provider: without one, a span records nothing.

        Asked at every claim, not once, because the application may set its
        provider after the relay started; the global tracer follows it then.
        """
        otel = self._otel
        self._unrecorded = (
            self._global
            and otel is not None
            and isinstance(otel.get_tracer_provider(), otel.unrecording_providers)
        )

    @staticmethod
    def clock() -> int:
        """A claim's start, for its span (nanoseconds since the epoch, as OpenTelemetry wants)."""
        return time.time_ns()

    def claimed(self, queue: str, count: int, started: int) -> None:
        """The ``claim {queue}`` span of a claim that returned ``count`` messages."""
        otel, tracer = self._otel, self._tracer
        if otel is None or tracer is None:
            return
        self._look_at_the_provider()  # for this claim's attempts too
        if self._unrecorded:
            return
        span = tracer.start_span(
            f"claim {queue}",
            context=otel.Context(),  # a root: never a child of whatever the serving code had current
            kind=otel.SpanKind.CLIENT,
            start_time=started,
            attributes={
                "messaging.system": SYSTEM,  # the outbox table is what is read, whatever the handlers
                "messaging.operation.type": "receive",
                "messaging.operation.name": "claim",
                "messaging.destination.name": queue,
                "messaging.batch.message_count": count,
            },
        )
        span.end()

    def process(self, queue: str, row: Any, *, batch: int | None = None) -> _Attempt | _Untraced:
        """The attempt's span as a context manager: current inside, ended on exit.

        An attempt that is one of a ``batch`` handed to the handler at once
        (``outbox_deliver_batch``) gets its own span all the same, carrying
        ``messaging.batch.message_count``, but none is made current: the
        handler's one call is no single message's child.

        In link mode the stored context is only read once the span is known to
        record: with the API but no SDK, an attempt costs nothing more (the
        claim that brought it looked at the global provider).
        """
        otel, tracer = self._otel, self._tracer
        if otel is None or tracer is None:
            return _UNTRACED
        if not self._child and self._unrecorded:
            # The API without an SDK: the no-op span of link mode would carry no context either,
            # so skip building it (its attributes and the event id's text were 7 % of a no-op
            # delivery's CPU).
            return _UNTRACED
        attributes: dict[str, Any] = {
            "messaging.system": self._systems.get(row.handler, SYSTEM),
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": str(row.event_id),
            "messaging.destination.name": queue,
            "outbox.handler": row.handler,
            "outbox.event_type": row.event_type,
            "outbox.message.row_id": row.id,
            "outbox.attempt": row.attempts,
        }
        if row.group_key is not None:
            attributes["messaging.message.conversation_id"] = row.group_key
        if batch is not None:
            attributes["messaging.batch.message_count"] = batch
        # A stored context without a valid span makes the SDK start a root, as in link mode.
        parent = (extract(row.headers) if self._child and row.headers else None) or otel.Context()
        span = tracer.start_span(
            f"process {row.handler}", context=parent, kind=otel.SpanKind.CONSUMER, attributes=attributes
        )
        if not self._child and row.headers and span.is_recording():
            stored = extract(row.headers)
            emitted = otel.get_current_span(stored).get_span_context() if stored is not None else None
            if emitted is not None and emitted.is_valid:
                span.add_link(emitted)
        if not span.is_recording() and not span.get_span_context().is_valid:
            return _UNTRACED  # no SDK and no context to pass on: nothing to make current
        return _Attempt(otel, span, current=batch is None)
