"""The relay's Prometheus endpoint, scraped over real HTTP and parsed with the prometheus parser."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import sessionmaker

from outbox import Backoff, Outbox, PermanentError, emit
from outbox.relay import Relay
from outbox.relay.metrics import RelayMetrics


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def test_metrics_and_health_endpoints(engine):
    ob = Outbox(default_backoff=Backoff(base=0.001, cap=0.002))

    @ob.handler("e", name="ok_route")
    def ok(msg):
        pass

    @ob.handler("e", name="bad_route", max_attempts=1)
    def bad(msg):
        raise PermanentError("nope")

    factory = sessionmaker(engine)
    ob.install(factory)
    metrics = RelayMetrics()
    port = metrics.serve("127.0.0.1", 0)
    relay = Relay(ob, engine, metrics=metrics, metrics_interval=0.05, poll_interval=0.05)
    thread = threading.Thread(target=relay.run)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 503  # not serving yet
        thread.start()
        with factory() as s, s.begin():
            for n in range(3):
                emit(s, "e", {"n": n})
        deadline = time.monotonic() + 10
        samples = scrape(port)
        while time.monotonic() < deadline:
            samples = scrape(port)
            done = samples.get(
                ("outbox_deliveries_total", (("handler", "ok_route"), ("outcome", "delivered")))
            )
            dead = samples.get(("outbox_messages", (("status", "dead"),)))
            if done == 3 and dead == 3:
                break
            time.sleep(0.05)
        assert samples[("outbox_deliveries_total", (("handler", "ok_route"), ("outcome", "delivered")))] == 3
        assert samples[("outbox_deliveries_total", (("handler", "bad_route"), ("outcome", "dead")))] == 3
        assert samples[("outbox_messages", (("status", "dead"),))] == 3
        assert samples[("outbox_messages", (("status", "pending"),))] == 0
        assert samples[("outbox_relay_up", ())] == 1
        assert samples[("outbox_delivery_latency_seconds_count", (("handler", "ok_route"),))] == 3
        assert samples[("outbox_attempt_duration_seconds_count", (("handler", "bad_route"),))] == 3
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
    finally:
        relay.stop()
        thread.join(10)
        metrics.close()
    ob.uninstall(factory)
