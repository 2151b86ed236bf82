"""Prometheus metrics and health endpoints for one relay.

Counters and histograms are updated as outcomes are recorded; gauges that need
the database (messages by status, oldest due and oldest unfinished message per
queue) come from a few cheap, indexed queries on a schedule, never per scrape,
so a scraping Prometheus cannot load the database. Each relay has its own registry: several relays in one test
process do not mix their figures.

Endpoints on ``--metrics-port``: ``/metrics``, ``/healthz`` (the process
answers) and ``/readyz`` (the last database round trip succeeded recently and,
when LISTEN is enabled, the LISTEN connection is up).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.engine import Engine

from outbox import ConfigurationError, Message, outbox_message, outbox_pause
from outbox._health_http import HealthServer
from outbox._tables import status_is_one_of

from .outcomes import Completion

__all__ = ["DURATION_BUCKETS", "RelayMetrics"]

m = outbox_message

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    900,
    3600,
)
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RelayMetrics:
    def __init__(self, *, stale_after: float = 30.0) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise ConfigurationError(
                "metrics need prometheus-client: pip install 'sqlalchemy-outbox[metrics]'"
            ) from None
        self.registry = CollectorRegistry()
        self.deliveries = Counter(
            "outbox_deliveries",
            "Attempts recorded, by route and outcome",
            ["handler", "outcome"],
            registry=self.registry,
        )
        self.attempt_duration = Histogram(
            "outbox_attempt_duration_seconds",
            "How long handlers ran",
            ["handler"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        # created_at is when the row was written: on PostgreSQL now(), the start of the
        # emitting transaction, so a long transaction adds its own duration here.
        self.latency = Histogram(
            "outbox_delivery_latency_seconds",
            "From the message's created_at (PostgreSQL: start of the emitting transaction) "
            "to the end of the successful attempt",
            ["handler"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.messages = Gauge(
            "outbox_messages",
            "Messages by status: pending, running, dead (not requeued: waiting for an operator), "
            "dead_requeued (dead originals that have a requeued copy); delivered and discarded "
            "are not counted",
            ["status"],
            registry=self.registry,
        )
        self.oldest_due = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Seconds since the oldest due pending message became due (available_at), by queue",
            ["queue"],
            registry=self.registry,
        )
        self.oldest_unfinished = Gauge(
            "outbox_oldest_unfinished_age_seconds",
            "Seconds since the oldest pending or running message was created (created_at), by queue; "
            "counts retries and delays that are not due yet",
            ["queue"],
            registry=self.registry,
        )
        self.paused = Gauge(
            "outbox_paused",
            "1 while a queue or handler is paused (outbox pause), 0 once resumed; kind is queue or handler",
            ["kind", "name"],
            registry=self.registry,
        )
        self.up = Gauge("outbox_relay_up", "1 while the relay is serving", registry=self.registry)
        self.breaker_open = Gauge(
            "outbox_breaker_open",
            "1 while a destination's circuit breaker is open",
            ["destination"],
            registry=self.registry,
        )
        self.stale_after = stale_after
        self._last_db_ok = 0.0
        self._listening: Callable[[], bool] = lambda: True
        self._server = HealthServer(self.registry, self.ready)
        self._breakers: list[Callable[[], dict[str, bool]]] = []
        self._queues: set[str] = set()
        self._unfinished_queues: set[str] = set()
        self._paused: set[tuple[str, str]] = set()

    # -- fed by the relay ------------------------------------------------------------

    def observe(self, message: Message, completion: Completion) -> None:
        self.deliveries.labels(message.handler, completion.outcome).inc()
        if completion.outcome == "expired":  # no handler ran: nothing to time
            return
        seconds = (completion.finished_at - completion.started_at).total_seconds()
        self.attempt_duration.labels(message.handler).observe(max(seconds, 0.0))
        if completion.status == "delivered" and message.created_at is not None:
            self.latency.labels(message.handler).observe(
                max((completion.finished_at - message.created_at).total_seconds(), 0.0)
            )

    def database_ok(self) -> None:
        self._last_db_ok = time.monotonic()

    def watch_listener(self, connected: Callable[[], bool]) -> None:
        self._listening = connected

    def watch_breakers(self, states: Callable[[], dict[str, bool]]) -> None:
        """A handler with breakers reports ``{destination: is_open}``."""
        self._breakers.append(states)

    def refresh(self, engine: Engine) -> None:
        """The scheduled queries behind the gauges: pending, running and dead rows only (indexed), pauses."""
        now = datetime.now(UTC)
        copy = m.alias("requeued_copy")
        has_copy = select(copy.c.id).where(copy.c.requeued_from == m.c.id).exists()
        with engine.connect() as conn:
            # One statement, so the gauges agree with each other: counted apart, a delivery
            # between two queries showed a message as pending and its neighbours as done.
            # A requeued original stays dead for the record: it is counted apart, so "dead"
            # falls when an operator acts and a "dead count rising" alert means new failures.
            rows = conn.execute(
                select(
                    m.c.status,
                    func.count(),
                    func.coalesce(func.sum(case((and_(m.c.status == "dead", has_copy), 1), else_=0)), 0),
                )
                .where(status_is_one_of("pending", "running", "dead"))
                .group_by(m.c.status)
            ).all()
            oldest = conn.execute(
                select(m.c.queue, func.min(m.c.available_at))
                .where(m.c.status == "pending", m.c.available_at <= _now_expr(engine, now))
                .group_by(m.c.queue)
            ).all()
            unfinished = conn.execute(
                select(m.c.queue, func.min(m.c.created_at))
                .where(m.c.status.in_(("pending", "running")))
                .group_by(m.c.queue)
            ).all()
            pauses = conn.execute(select(outbox_pause.c.kind, outbox_pause.c.name)).all()
        paused: set[tuple[str, str]] = {(kind, name) for kind, name in pauses}
        counts = {status: int(count) - int(requeued) for status, count, requeued in rows}
        counts["dead_requeued"] = sum(int(requeued) for _, _, requeued in rows)
        for status in ("pending", "running", "dead", "dead_requeued"):
            self.messages.labels(status).set(counts.get(status, 0))
        self._queues = _set_ages(self.oldest_due, oldest, self._queues, now)
        self._unfinished_queues = _set_ages(self.oldest_unfinished, unfinished, self._unfinished_queues, now)
        for kind, name in paused:
            self.paused.labels(kind, name).set(1)
        for kind, name in self._paused - paused:
            self.paused.labels(kind, name).set(0)
        self._paused |= paused
        for states in self._breakers:
            for destination, is_open in states().items():
                self.breaker_open.labels(destination).set(1 if is_open else 0)
        self.database_ok()

    # -- health -----------------------------------------------------------------------

    def ready(self) -> tuple[bool, str]:
        if time.monotonic() - self._last_db_ok > self.stale_after:
            return False, "database not reached recently"
        if not self._listening():
            return False, "LISTEN connection down"
        return True, "ok"

    # -- HTTP -------------------------------------------------------------------------

    def serve(self, host: str, port: int) -> int:
        """Start the endpoint in a daemon thread; returns the bound port (useful with port 0)."""
        return self._server.serve(host, port)

    def close(self) -> None:
        self._server.close()


def _set_ages(gauge: Any, rows: Sequence[Any], known: set[str], now: datetime) -> set[str]:
    """Set ``gauge`` per queue from (queue, timestamp) rows; queues that drained go back to 0."""
    seen: set[str] = set()
    for queue, first in rows:
        if first is not None:
            seen.add(queue)
            gauge.labels(queue).set(max((now - first).total_seconds(), 0.0))
    for queue in known - seen:
        gauge.labels(queue).set(0)
    return known | seen


def _now_expr(engine: Engine, now: datetime) -> Any:
    if engine.dialect.name == "postgresql":
        return func.now()
    from sqlalchemy import literal

    return literal(now, m.c.available_at.type)
