"""The relay's Prometheus endpoint, scraped over real HTTP and parsed with the prometheus parser.

In-process (a Relay with its RelayMetrics) on both databases, and as operators run it: the
``outbox-relay --metrics-port`` console script in a subprocess, on PostgreSQL, serving
tests/apps/metrics_app.py against a local failing webhook endpoint.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from relayproc import RelayProcess, wait_until
from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import sessionmaker
from test_webhook import Receiver, Reply

from outbox import Backoff, Outbox, PermanentError, emit, ops, outbox_message, signals
from outbox.relay import Relay
from outbox.relay.metrics import RelayMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int, timeout: float = 5.0) -> Samples:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=timeout).text
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
            pending = samples.get(("outbox_messages", (("status", "pending"),)))
            if done == 3 and dead == 3 and pending == 0:  # the gauges are a snapshot every 0.05 s
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

        # A requeued original stays dead for the record: the gauge moves it to dead_requeued.
        (original,) = [r.id for r in ops.list_messages(engine, ops.MessageFilter(status="dead"), limit=1)]
        ops.requeue(engine, ops.MessageFilter(ids=(original,)), reason="retry it", actor="t")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            samples = scrape(port)
            if (
                samples.get(("outbox_messages", (("status", "dead_requeued"),))),
                samples.get(("outbox_messages", (("status", "dead"),))),
            ) == (1, 3):
                break
            time.sleep(0.05)
        # The copy died too (bad_route always fails): 2 untouched originals + the copy need a decision.
        assert samples[("outbox_messages", (("status", "dead_requeued"),))] == 1
        assert samples[("outbox_messages", (("status", "dead"),))] == 3
    finally:
        relay.stop()
        thread.join(10)
        metrics.close()
    ob.uninstall(factory)


# -- the console script ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def failing_endpoint() -> Iterator[Receiver]:
    receiver = Receiver()
    receiver.default = Reply(500, body=b"partner is down")
    receiver.thread.start()
    yield receiver
    receiver.released.set()
    receiver.server.shutdown()
    receiver.server.server_close()


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def get(port: int, path: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)


def emit_for_the_metrics_app(engine: Engine) -> None:
    """Messages for both routes of tests/apps/metrics_app.py and one for a route no relay serves."""
    ob = Outbox()
    for event, name, queue in (
        ("partner.notified", "partner_webhook", "webhooks"),
        ("crm.sync", "crm_sync", "crm"),
        ("ledger.posted", "ledger", "slow"),  # no relay has this route: it stays pending and due
    ):
        ob.route(event, lambda msg: None, name=name, queue=queue)
    maker = sessionmaker(engine)
    ob.install(maker)
    try:
        with maker.begin() as s:
            for event in ("partner.notified", "crm.sync", "ledger.posted"):
                emit(s, event, {"n": 1})
    finally:
        ob.uninstall(maker)
    m = outbox_message
    with engine.begin() as conn:  # as if the ledger row had waited an hour, the CRM sync two
        for handler, age in (("ledger", timedelta(hours=1)), ("crm_sync", timedelta(hours=2))):
            stamp = conn.execute(select(m.c.created_at).where(m.c.handler == handler)).scalar_one()
            conn.execute(
                update(m)
                .where(m.c.handler == handler)
                .values(created_at=stamp - age, available_at=stamp - age)
            )


def test_the_relay_console_script_serves_metrics_and_health(pg_url, pg_engine, failing_endpoint, tmp_path):
    emit_for_the_metrics_app(pg_engine)
    port = free_port()
    relay = RelayProcess(
        pg_url,
        ["--app", "metrics_app:ob", "--metrics-port", str(port), "--poll-interval", "0.2"],
        log_path=tmp_path / "relay.log",
        env={"METRICS_HOOK_URL": failing_endpoint.url()},
    )
    database = make_url(pg_url).database
    admin = create_engine(make_url(pg_url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        wait_until(lambda: _answers(port, "/readyz") == 200, "the relay to be ready", relays=[relay])
        assert get(port, "/healthz").status_code == 200
        destination = f"127.0.0.1:{failing_endpoint.port}"

        # The gauges come from the scheduled refresh (every 10 s): wait for one after the failures.
        def settled() -> Samples | None:
            samples = scrape(port)
            wanted = (
                sample(samples, "outbox_breaker_open", destination=destination) == 1,
                sample(samples, "outbox_oldest_unfinished_age_seconds", queue="crm") is not None,
                sample(samples, "outbox_oldest_pending_age_seconds", queue="crm") in (None, 0),
            )
            return samples if all(wanted) else None

        samples = wait_until(settled, "the breaker gauge and the retry ages", timeout=40, relays=[relay])
        assert len(failing_endpoint.requests) == 1, "the breaker opened after one failure"
        assert sample(samples, "outbox_relay_up") == 1
        assert sample(samples, "outbox_deliveries_total", handler="partner_webhook", outcome="retry") == 2
        assert sample(samples, "outbox_deliveries_total", handler="crm_sync", outcome="retry") == 1
        assert sample(samples, "outbox_messages", status="pending") == 3
        assert sample(samples, "outbox_messages", status="dead") == 0
        # Waiting an hour for a relay that has no such route: due, so the due-age gauge sees it.
        assert 3600 <= (sample(samples, "outbox_oldest_pending_age_seconds", queue="slow") or 0) < 3600 + 300
        # Retrying for two hours, next try in an hour: not due, so only the created_at gauge sees it.
        crm_age = sample(samples, "outbox_oldest_unfinished_age_seconds", queue="crm") or 0
        assert 7200 <= crm_age < 7200 + 300
        body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        help_of = {f.name: f.documentation for f in text_string_to_metric_families(body)}
        assert "created_at" in help_of["outbox_delivery_latency_seconds"]

        # A scrape never queries the database: with the table locked, scrapes still answer at once.
        locker = pg_engine.connect()
        try:
            locker.execute(text("LOCK TABLE outbox_message IN ACCESS EXCLUSIVE MODE"))
            started = time.monotonic()
            for _ in range(20):
                assert sample(scrape(port, timeout=2), "outbox_messages", status="pending") == 3
            assert time.monotonic() - started < 5
        finally:
            locker.rollback()
            locker.close()

        # /readyz follows the LISTEN connection: killed (and kept from reconnecting) -> 503, back -> 200.
        listener = wait_until(lambda: _listener_pid(admin, database), "the LISTEN connection", relays=[relay])
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false'))
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": listener}).scalar_one()
        try:
            wait_until(lambda: _answers(port, "/readyz") == 503, "/readyz to fail", relays=[relay])
            assert get(port, "/readyz").text == "LISTEN connection down\n"
            assert get(port, "/healthz").status_code == 200, "the process itself is fine"
            time.sleep(1)  # it keeps failing while the database refuses new connections
            assert get(port, "/readyz").status_code == 503
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true'))
        wait_until(lambda: _answers(port, "/readyz") == 200, "/readyz to recover", relays=[relay])
        assert _listener_pid(admin, database) not in (None, listener), "a new LISTEN connection"
        assert any(r.get("action") == "listen_retry" for r in relay.records())

        relay.signal(signal.SIGTERM)
        assert relay.wait(30) == 0, relay.tail()
    finally:
        relay.kill()
        admin.dispose()


def _answers(port: int, path: str) -> int | None:
    try:
        return get(port, path).status_code
    except httpx.TransportError:
        return None


def _listener_pid(admin: Engine, database: str | None) -> Any:
    with admin.connect() as conn:
        return conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = :db AND application_name = 'outbox-relay listen'"
            ),
            {"db": database},
        ).scalar()


class FlakyBreakers:
    """A handler whose breaker report fails twice (user code), then works.

    Twice, because the relay's registry reads it first, when the relay starts
    (then every registry_interval); the metrics refresh's first read fails too.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, msg: Any) -> None:
        pass

    def outbox_breaker_states(self) -> dict[str, bool]:
        self.calls += 1
        if self.calls <= 2:
            raise RuntimeError("breaker report bug")
        return {"partner.example": True}


def test_a_failing_breaker_report_does_not_stop_the_metrics_refresh(engine, caplog):
    ob = Outbox()
    ob.route("e", FlakyBreakers(), name="flaky")
    metrics = RelayMetrics()
    relay = Relay(ob, engine, metrics=metrics, metrics_interval=0.05, poll_interval=0.05, listen=False)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(
            lambda: metrics.breaker_open.labels("partner.example")._value.get() == 1,
            "the breaker gauge set by a later refresh",
            timeout=10,
        )
    finally:
        relay.stop()
        thread.join(10)
    assert any("breaker report bug" in r.getMessage() or r.exc_info for r in caplog.records)
    restarts = [r for r in caplog.records if getattr(r, "action", "") == "task_restart"]
    assert [r.task for r in restarts] == ["outbox-metrics"], "the metrics refresh itself met the failure"


def test_relay_listening_is_sent_each_time_listen_is_up_and_readyz_agrees(pg_engine):
    ob = Outbox()
    ob.route("e", lambda msg: None, name="r")
    heard: list[tuple[bool, tuple[bool, str]]] = []
    metrics = RelayMetrics()

    def on_listening(sender: Outbox, relay: Relay) -> None:
        heard.append((relay.listening, metrics.ready()))

    signals.relay_listening.connect(on_listening, sender=ob)
    relay = Relay(ob, pg_engine, metrics=metrics, poll_interval=0.2)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        wait_until(lambda: heard, "relay_listening")
        assert heard[0][0] is True and heard[0][1][1] != "LISTEN connection down"
        wait_until(lambda: metrics.ready() == (True, "ok"), "ready once listening and claiming")
        with pg_engine.connect() as conn:  # the LISTEN connection dies: not ready until it is back
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'outbox-relay listen' AND datname = current_database()"
                )
            )
        wait_until(lambda: len(heard) == 2, "relay_listening again after the reconnect", timeout=30)
        assert heard[1][0] is True and relay.listening
        assert metrics.ready() == (True, "ok")
    finally:
        signals.relay_listening.disconnect(on_listening, sender=ob)
        relay.stop()
        thread.join(20)
    assert not thread.is_alive()
