"""Mode 1b: mode 1's emit overhead with an SDK tracer active, against the same figure without OpenTelemetry.

Four kinds of transaction alternate in one loop (ABCD, then DCBA), each
inserting one domain row, as in mode 1:

- ``plain`` and ``emit``: mode 1's kinds, with the outbox behaving exactly as
  without the ``[otel]`` extra (its lazily loaded API set to "missing") and no
  span current;
- ``plain_traced`` and ``emit_traced``: the same two inside a ``request`` span
  of an SDK tracer (a batch processor to an exporter that drops everything),
  the API loaded, so ``emit()`` stores the trace context with the event.

Emit overhead is plain rate / emit rate, with and without tracing. The
headline ratio divides the traced overhead by the untraced one: what tracing
adds to the cost of emitting, with the application's own span (paid by plain
and emitting transactions alike) cancelled out. ``tracer_ratio`` (emit rate /
emit_traced rate) is the whole difference a traced application sees,
its own span included. The check: every emitting transaction's event is
stored once, with a ``traceparent`` exactly when traced.
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from sqlalchemy import create_engine, select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import sessionmaker

from outbox import _tracing, emit, outbox_message

from .app import EVENTS
from .emit import WARMUP, Base, Order, interleaved, outbox_sessions
from .verify import Unverified

__all__ = ["emit_tracing_overhead"]

KINDS = ("plain", "emit", "plain_traced", "emit_traced")


class _Dropped(SpanExporter):
    """An exporter that sends nowhere: the figure is the tracer's cost in the request, not a network's."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def emit_tracing_overhead(url: URL, *, transactions: int) -> dict[str, Any]:
    loaded = _tracing.api()
    if loaded is None:
        raise RuntimeError("opentelemetry-api is not installed (pip install -e '.[dev]')")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Dropped()))
    tracer = provider.get_tracer("bench")
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    plain = sessionmaker(engine, expire_on_commit=False)
    installed = outbox_sessions()
    installed.configure(bind=engine)

    def transaction(kind: str, n: int) -> None:
        with (installed if kind.startswith("emit") else plain)() as session, session.begin():
            session.add(Order(n=n, kind=kind, note=f"order {n}"))
            if kind.startswith("emit"):
                emit(session, EVENTS["noop"], {"n": n, "order": f"order {n}"})

    def once(kind: str, n: int) -> float:
        traced = kind.endswith("_traced")
        _tracing._api = loaded if traced else None
        began = time.perf_counter()
        if traced:
            with tracer.start_as_current_span("request"):
                transaction(kind, n)
        else:
            transaction(kind, n)
        return time.perf_counter() - began

    try:
        spent = interleaved(KINDS, transactions, once)
        _tracing._api = loaded
        inject_us = _inject_cost(tracer)
        _verify(engine, WARMUP + transactions)
    finally:
        _tracing._api = loaded
        provider.shutdown()
        engine.dispose()
    rates = {kind: transactions / seconds for kind, seconds in spent.items()}
    without = rates["plain"] / rates["emit"]
    with_tracing = rates["plain_traced"] / rates["emit_traced"]
    return {
        "ratio": with_tracing / without,
        "overhead_without": without,
        "overhead_with": with_tracing,
        "tracer_ratio": rates["emit"] / rates["emit_traced"],
        "rates": rates,
        "inject_us": inject_us,
    }


def _inject_cost(tracer: Any, calls: int = 20_000) -> float:
    """Microseconds per ``emit()`` spent storing the trace context, inside a recording span."""
    with tracer.start_as_current_span("request"):
        best = min(timeit.repeat(lambda: _tracing.emit_headers({}, baggage=False), number=calls, repeat=5))
    return best / calls * 1e6


def _verify(engine: Engine, per_kind: int) -> None:
    m = outbox_message
    with engine.connect() as conn:
        kinds = dict(conn.execute(select(Order.n, Order.kind)).all())
        stored = conn.execute(select(m.c.payload, m.c.headers)).all()
    emitting = {n for n, kind in kinds.items() if kind.startswith("emit")}
    if len(kinds) != len(KINDS) * per_kind or len(emitting) != 2 * per_kind:
        raise Unverified(f"{len(kinds)} domain rows, {len(emitting)} of them emitting")
    numbers = [row.payload["n"] for row in stored]
    if len(numbers) != len(emitting) or set(numbers) != emitting:
        raise Unverified(f"{len(numbers)} events stored for {len(emitting)} emitting transactions")
    for row in stored:
        kind = kinds[row.payload["n"]]
        if ("traceparent" in (row.headers or {})) != (kind == "emit_traced"):
            raise Unverified(f"an {kind} transaction stored headers {row.headers!r}")
