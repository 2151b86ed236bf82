"""The Kafka publisher's producer: one per relay, with the thread that serves its delivery reports.

``poll()`` blocks, so it runs on a thread of its own; the reports one poll
serves reach the relay's loop in one thread-safe call. librdkafka's logs and
client errors are masked and rate-limited here; a fatal error marks the
session, and the publisher replaces it at its next message.

The session also keeps track of whether every broker is down: librdkafka
reports ``_ALL_BROKERS_DOWN`` through the error callback, but nothing when a
broker is back, so while they are down a probe thread asks for the cluster's
metadata every ``PROBE_INTERVAL`` seconds, and its first answer ends the
outage (:class:`~outbox.integrations._broker_recovery.Recovery`: the messages
parked on the cluster are released, in every relay).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from outbox._redact import Redactor

from ._broker_recovery import PROBE_INTERVAL, Recovery

__all__ = ["ERROR_LOG_INTERVAL", "Logger", "Report", "Session"]

log = logging.getLogger("outbox.integrations.kafka")
_librdkafka_log = logging.getLogger("outbox.integrations.kafka.librdkafka")

#: librdkafka's errors (other than a fatal one) are logged at most this often per kind.
ERROR_LOG_INTERVAL = 60.0


class Logger:
    """What confluent-kafka's ``logger`` needs (a ``log`` method), masking secrets on the way.

    While a broker refuses connections librdkafka logs each failed attempt, an
    ERROR line many times a second; a warning or error that differs from an
    earlier one only in its numbers (ports, milliseconds) is logged at most
    once per ``ERROR_LOG_INTERVAL``, and the next one says how many were left
    out. Lines below WARNING (``debug`` contexts asked for) all pass.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if not _librdkafka_log.isEnabledFor(level):
            return
        try:
            text = fmt % args if args else str(fmt)
        except (TypeError, ValueError):
            text = " ".join(map(str, (fmt, *args)))
        if level >= logging.WARNING:
            kind = _NUMBERS.sub("#", text)
            now = time.monotonic()
            if now - self._last.get(kind, -math.inf) < ERROR_LOG_INTERVAL:
                self._left_out[kind] = self._left_out.get(kind, 0) + 1
                return
            if len(self._last) >= _KINDS_KEPT:  # bounded: forget every kind, log each once more
                self._last.clear()
            self._last[kind] = now
            left_out = self._left_out.pop(kind, 0)
            if left_out:
                text += f" ({left_out} more like this in the last {ERROR_LOG_INTERVAL:.0f}s not logged)"
        _librdkafka_log.log(level, "%s", self._redactor.text(text))


_NUMBERS = re.compile(r"\d+")
_KINDS_KEPT = 1000


Report = tuple[KafkaError | None, int, int]  # a delivery report: error (None: written), partition, offset


class Session:
    """One producer and the one thread that serves its delivery reports, for one relay (event loop).

    ``poll()`` blocks, so it runs on a thread of its own. The reports one
    ``poll()`` serves settle their messages' futures on the relay's loop in
    one thread-safe call, not one wake-up of the loop per message.
    """

    def __init__(
        self, config: dict[str, Any], redactor: Redactor, loop: asyncio.AbstractEventLoop, recovery: Recovery
    ) -> None:
        self.fatal: KafkaError | None = None
        self._recovery = recovery
        #: every broker is down: set by librdkafka's report, cleared by the probe's first answer
        self.away = False
        self._probe: threading.Thread | None = None
        self._loop = loop
        self._reports: list[tuple[asyncio.Future[Report], Report]] = []  # served, not yet handed over
        self._redactor = redactor
        self._logged: dict[int, float] = {}
        self._refreshing: dict[str, threading.Thread] = {}
        self._refresh_lock = threading.Lock()
        self.producer = Producer({**config, "error_cb": self._on_error, "logger": Logger(redactor)})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="outbox-kafka-reports", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self.producer.poll(0.1)  # returns at once when a report is ready
            except KafkaException as exc:  # how confluent-kafka raises a fatal error
                if exc.args and isinstance(exc.args[0], KafkaError):
                    self._on_error(exc.args[0])
            except Exception:  # never let the thread end: every waiting attempt would time out
                log.exception("Kafka delivery report handling failed")
            self._hand_over()

    def report(self, future: asyncio.Future[Report], err: KafkaError | None, msg: Any) -> None:
        """The delivery callback, on the thread that polls: noted, handed to the loop after the poll."""
        self._reports.append((future, (err, msg.partition(), msg.offset())))

    def _hand_over(self) -> None:
        if not self._reports:
            return
        reports, self._reports = self._reports, []
        try:
            self._loop.call_soon_threadsafe(_settle, reports)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _on_error(self, err: KafkaError) -> None:
        """Client-level errors (brokers down, authentication); each message's fate is in its own report."""
        text = self._redactor.text(err.str())
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._all_down(text)
        if err.fatal():
            self.fatal = err  # the idempotent producer cannot go on: the next message gets a new one
            log.error("Kafka producer failed fatally (%s): %s; it will be replaced", err.name(), text)
            return
        now = time.monotonic()
        if now - self._logged.get(err.code(), -math.inf) >= ERROR_LOG_INTERVAL:
            self._logged[err.code()] = now
            log.warning("Kafka client error %s: %s", err.name(), text)

    def _all_down(self, why: str) -> None:
        """Every broker is down: park what comes, and probe until the cluster answers again."""
        with self._refresh_lock:
            if self.away or self._stop.is_set():
                return
            self.away = True
            self._probe = threading.Thread(target=self._run_probe, name="outbox-kafka-probe", daemon=True)
        self._recovery.away(why)
        self._probe.start()

    def _run_probe(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL):
            try:
                self.producer.list_topics(timeout=PROBE_INTERVAL)
            except Exception:  # still down: librdkafka reconnects meanwhile
                continue
            self.away = False
            self._recovery.back()
            return

    def refresh(self, topic: str) -> None:
        """Fetch ``topic``'s metadata in the background, so the next attempt sees the cluster as it is now."""
        with self._refresh_lock:
            if topic in self._refreshing or self._stop.is_set():
                return
            thread = self._refreshing[topic] = threading.Thread(
                target=self._refresh, args=(topic,), name="outbox-kafka-metadata", daemon=True
            )
        thread.start()

    def _refresh(self, topic: str) -> None:
        try:
            self.producer.list_topics(topic, timeout=5)
        except Exception as exc:  # the cluster is away: the next attempt's own error tells
            log.debug("Kafka metadata refresh for %s failed: %s", topic, self._redactor.text(str(exc)))
        finally:
            with self._refresh_lock:
                self._refreshing.pop(topic, None)

    def close(self, timeout: float) -> int:
        """Stop the report thread, wait up to ``timeout`` for what is in flight; how many were left."""
        self._stop.set()
        self._thread.join()
        with self._refresh_lock:
            refreshing = list(self._refreshing.values())
            if self._probe is not None:
                refreshing.append(self._probe)
        for thread in refreshing:  # the producer must outlive their requests
            thread.join()
        left = self.producer.flush(timeout)
        if left:
            self.producer.purge()  # their attempts have already timed out and will be retried
            self.producer.poll(0)
        self._hand_over()
        self.producer.close()
        return left


def _settle(reports: list[tuple[asyncio.Future[Report], Report]]) -> None:
    """On the loop: each report to the coroutine waiting for it."""
    for future, report in reports:
        if not future.done():  # the attempt may have timed out or been cancelled meanwhile
            future.set_result(report)
