"""Prometheus metrics and health endpoints for one consumer process.

Counted where the outcome is known (the runtime's ``take``), never by a
query per scrape. ``/readyz`` answers 200 only while every source holds a
connection to its broker and the database answered recently: a consumer that
cannot commit must not be counted as serving.
"""

from __future__ import annotations

import time

from outbox import ConfigurationError
from outbox._health_http import HealthServer
from outbox.relay.metrics import DURATION_BUCKETS

__all__ = ["ConsumerMetrics", "OUTCOMES"]

#: ``outbox_inbox_messages_total``'s outcome label: the four committed outcomes, and two that are not.
OUTCOMES = ("handled", "duplicate", "unhandled", "dead", "failed", "error")


class ConsumerMetrics:
    def __init__(self, *, stale_after: float = 30.0) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError:
            raise ConfigurationError(
                "metrics need prometheus-client: pip install 'sqlalchemy-outbox[metrics]'"
            ) from None
        self.registry = CollectorRegistry()
        self.messages = Counter(
            "outbox_inbox_messages",
            "Deliveries taken, by inbox, source and outcome: handled, duplicate, unhandled, dead "
            "(committed); failed (a handler raised, redelivered later), error (the database failed)",
            ["inbox", "source", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "outbox_inbox_process_seconds",
            "One delivery's transaction: marker, handlers and commit",
            ["inbox", "source"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "outbox_inbox_in_flight",
            "Deliveries being processed now",
            ["inbox", "source"],
            registry=self.registry,
        )
        self.acks_failed = Counter(
            "outbox_inbox_acks_failed",
            "Committed outcomes whose acknowledgement to the broker failed (the redelivery is a duplicate)",
            ["inbox", "source"],
            registry=self.registry,
        )
        self.source_up = Gauge(
            "outbox_inbox_source_up",
            "1 while the source holds a working connection to its broker",
            ["inbox", "source"],
            registry=self.registry,
        )
        self.up = Gauge("outbox_consumer_up", "1 while the consumer is serving", registry=self.registry)
        self.stale_after = stale_after
        self._last_db_ok = 0.0
        self._sources: dict[str, bool] = {}
        self._server = HealthServer(self.registry, self.ready)

    def database_ok(self) -> None:
        self._last_db_ok = time.monotonic()

    def source_connected(self, inbox: str, source: str, up: bool) -> None:
        self._sources[source] = up
        self.source_up.labels(inbox, source).set(1 if up else 0)

    def ready(self) -> tuple[bool, str]:
        if time.monotonic() - self._last_db_ok > self.stale_after:
            return False, "database not reached recently"
        down = sorted(name for name, up in self._sources.items() if not up)
        if down:
            return False, "not connected: " + ", ".join(down)
        return True, "ok"

    def serve(self, host: str, port: int) -> int:
        """Start the endpoint in a daemon thread; returns the bound port (useful with port 0)."""
        return self._server.serve(host, port)

    def close(self) -> None:
        self._server.close()
