"""The relay's orchestration: claim, dispatch, write back, renew leases, recover, shut down.

One asyncio loop owns all state. Database calls are short synchronous
SQLAlchemy statements (``store``) run on a small thread pool; handlers run on
the loop (``async def``) or on daemon threads (plain functions). Outcomes are
written back in batches by a single writer task, so a burst of deliveries costs
one transaction, not one per message.

Nothing here trusts the LISTEN connection: wake-ups make the relay claim sooner,
and the poll interval makes it claim anyway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError, SQLAlchemyError

from outbox import ConfigurationError, Message, Outbox, OutboxError, outbox_message, signals
from outbox._redact import Redactor
from outbox._routes import check_name

from .db import Listener, LoopConnection, make_engine, supports_listen
from .dispatch import attempt, secrets_of
from .metrics import RelayMetrics
from .store import Completion, GroupPolicy, Store, utcnow
from .threads import DaemonPool

__all__ = ["DatabaseUnavailable", "DrainResult", "Relay"]

log = logging.getLogger("outbox.relay")

T = TypeVar("T")

#: Seconds between warnings about pending rows for routes this relay has no handler for.
_UNKNOWN_REPORT_EVERY = 300.0


class DatabaseUnavailable(OutboxError):
    """The relay could not reach its database, or the outbox tables are missing, at start-up."""


@dataclass(slots=True)
class DrainResult:
    """What one :meth:`Relay.run_until_idle` did."""

    delivered: int = 0
    retried: int = 0
    dead: int = 0
    recovered: int = 0

    @property
    def attempts(self) -> int:
        return self.delivered + self.retried + self.dead


def _positive(what: str, value: object, *, integer: bool = False, zero: bool = False) -> Any:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    ok = (
        not isinstance(value, bool)
        and isinstance(value, kinds)
        and math.isfinite(float(value))  # type: ignore[arg-type]
        and (value >= 0 if zero else value > 0)  # type: ignore[operator]
    )
    if not ok:
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if zero else "> 0"
        raise ConfigurationError(f"{what} must be {kind} {bound}, got {value!r}")
    return value


def _default_relay_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _first_line(exc: BaseException) -> str:
    text_ = str(getattr(exc, "orig", None) or exc).strip()
    return text_.splitlines()[0] if text_ else type(exc).__name__


class Relay:
    """Delivers committed outbox messages to the handlers an :class:`~outbox.Outbox` routes them to.

    ``run()`` serves until stopped (SIGTERM/SIGINT when ``install_signal_handlers``
    is set, or :meth:`stop` from any thread); ``run_until_idle()`` delivers what is
    due and returns, for tests, scripts and ``outbox-relay --once``.
    """

    def __init__(
        self,
        outbox: Outbox,
        database: Engine | str | URL,
        *,
        queues: Iterable[str] | None = None,
        concurrency: int = 10,
        queue_concurrency: Mapping[str, int] | None = None,
        batch_size: int | None = None,
        poll_interval: float = 1.0,
        lease: float = 30.0,
        listen: bool = True,
        grace_period: float = 30.0,
        group_policy: GroupPolicy = "block",
        relay_id: str | None = None,
        seed: int | None = None,
        metrics: RelayMetrics | None = None,
        metrics_interval: float = 10.0,
    ) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(f"Relay needs an outbox.Outbox, got {outbox!r}")
        if not outbox.routes:
            raise ConfigurationError("the Outbox has no routes: a relay would have nothing to deliver")
        self.outbox = outbox
        self.concurrency: int = _positive("concurrency", concurrency, integer=True)
        self.batch_size: int = _positive(
            "batch_size", batch_size if batch_size is not None else concurrency, integer=True
        )
        self.poll_interval: float = _positive("poll_interval", poll_interval)
        self.lease: float = _positive("lease", lease)
        self.grace_period: float = _positive("grace_period", grace_period, zero=True)
        if group_policy not in ("block", "skip"):
            raise ConfigurationError(f"group_policy must be 'block' or 'skip', got {group_policy!r}")
        self.queues = None if queues is None else tuple(dict.fromkeys(check_name("queue", q) for q in queues))
        if self.queues is not None and not self.queues:
            raise ConfigurationError("queues must name at least one queue (or be None for every queue)")
        self.queue_concurrency = {
            check_name("queue", q): _positive(f"queue_concurrency[{q!r}]", n, integer=True)
            for q, n in (queue_concurrency or {}).items()
        }
        self.id = check_name("relay_id", relay_id) if relay_id is not None else _default_relay_id()
        self._owns_engine = not isinstance(database, Engine)
        self.engine = make_engine(database)
        self.listen = listen and supports_listen(self.engine)
        self.store = Store(self.engine, self.id, lease=self.lease, group_policy=group_policy)
        self._routes = {r.name: r for r in outbox.routes}
        self._handlers = sorted(self._routes)
        self._backoffs = {r.name: r.backoff for r in outbox.routes}
        self._redactor = Redactor(secrets_of(r.handler for r in outbox.routes))
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_lock = threading.Lock()
        self._early_stop: bool | None = None  # a stop() that came before the loop ran
        self.listener: Listener | None = None
        self.metrics = metrics
        self.metrics_interval: float = _positive("metrics_interval", metrics_interval)
        if metrics is not None:
            for route in outbox.routes:
                states = getattr(route.handler, "outbox_breaker_states", None)
                if callable(states):
                    metrics.watch_breakers(states)

    def __repr__(self) -> str:
        return f"<Relay {self.id} routes={len(self._routes)}>"

    # -- public entry points ------------------------------------------------------

    def run(self, *, install_signal_handlers: bool = False) -> None:
        """Serve until stopped. Signal handlers can only be installed from the main thread."""
        asyncio.run(self.serve(install_signal_handlers=install_signal_handlers))

    def run_until_idle(self) -> DrainResult:
        """Deliver everything due now (retries that become due meanwhile included), then return."""
        return asyncio.run(self.drain())

    def stop(self, *, graceful: bool = True) -> None:
        """Ask a running relay to stop; safe from any thread and from signal handlers.

        Graceful: stop claiming, let in-flight deliveries finish within the grace
        period. Not graceful (or a second call): cancel in-flight work now.
        Either way claimed-but-unstarted messages are released untouched.
        """
        with self._stop_lock:
            loop = self._loop
            if loop is None or loop.is_closed():
                # Not serving yet (a thread just started run()): the stop waits for the loop.
                self._early_stop = graceful if self._early_stop is None else self._early_stop and graceful
                return
        try:
            loop.call_soon_threadsafe(self._request_stop, graceful)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    # -- lifecycle ---------------------------------------------------------------------

    def _open(self) -> None:
        self._thread = threading.current_thread()
        self._wake = asyncio.Event()
        self._force = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._stopping = False
        # Keyed by (id, attempt): a message this relay lost and claimed again runs twice for a while.
        self._inflight: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._by_queue: Counter[str] = Counter()
        self._unstarted: list[int] = []
        self._buffer: list[tuple[Message, Completion]] = []
        self._buffered = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._saturated = False
        self._known_queues: set[str] = {r.queue for r in self.outbox.routes}
        self._next_discovery = 0.0
        self._db_pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="outbox-db")
        # Claims skip the WAL flush wait: a claim lost to a server crash only leaves its
        # messages pending, to be claimed again (at-least-once holds); outcomes and history
        # are written with the server's own durability setting.
        self._claimer = (
            LoopConnection(self.engine, settings="SET synchronous_commit = off") if self.store.fast else None
        )
        self._recorder = LoopConnection(self.engine, "outbox-relay write") if self.store.fast else None
        self._handler_pool = DaemonPool(self.concurrency + 2)
        self._result = DrainResult()
        self._background: list[asyncio.Task[Any]] = []
        self._next_unknown_report = 0.0
        with self._stop_lock:
            self._loop = asyncio.get_running_loop()
            early, self._early_stop = self._early_stop, None
        if early is not None:
            self._request_stop(early)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        assert self._loop is not None
        return await self._loop.run_in_executor(self._db_pool, lambda: fn(*args))

    async def _check_database(self) -> None:
        try:
            await self._db(self._probe)
        except SQLAlchemyError as exc:
            url = self.engine.url.render_as_string(hide_password=True)
            if "outbox_message" in str(exc) or "UndefinedTable" in type(getattr(exc, "orig", exc)).__name__:
                raise DatabaseUnavailable(
                    f"the outbox tables are missing in {url}: run `outbox migrate --database-url ...` first"
                ) from None
            raise DatabaseUnavailable(f"cannot reach the database at {url}: {_first_line(exc)}") from None

    def _probe(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(select(outbox_message.c.id).limit(0))

    def _bind_handlers(self) -> None:
        """Offer each handler the relay's engine (``outbox_bind(engine)``), once the database answers.

        A handler that keeps state in the database, such as the email sent-log,
        then needs no engine of its own in its configuration.
        """
        for route in self._routes.values():
            hook = getattr(route.handler, "outbox_bind", None)
            if callable(hook):
                hook(self.engine)

    async def _shutdown_handlers(self) -> None:
        """Let handlers close what they opened on this loop (HTTP clients, SMTP connections).

        A handler object may define ``outbox_shutdown()``, plain or async; a
        failure there is logged, never raised, so one handler cannot keep the
        relay from stopping.
        """
        for route in self._routes.values():
            hook = getattr(route.handler, "outbox_shutdown", None)
            if not callable(hook):
                continue
            try:
                result = hook()
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    await result
            except Exception as exc:
                log.warning(
                    "route %s: outbox_shutdown failed: %s",
                    route.name,
                    self._redactor.text(str(exc)),
                    extra={"action": "handler_shutdown", "handler": route.name},
                )

    async def _close_loop_connections(self) -> None:
        for conn in (self._claimer, self._recorder):
            if conn is not None:
                await conn.close()

    def _close(self) -> None:
        self._db_pool.shutdown(wait=True)
        self._handler_pool.shutdown(wait=False)
        if self._owns_engine:
            self.engine.dispose()
        with self._stop_lock:
            self._loop = None

    def _request_stop(self, graceful: bool) -> None:
        if self._stopping or not graceful:
            self._force.set()
        if not self._stopping:
            log.info("stopping: no new claims", extra={"action": "stop", "relay_id": self.id})
        self._stopping = True
        self._stop_requested.set()
        self._wake.set()

    def _on_commit(self, sender: Any, **kwargs: Any) -> None:
        """messages_committed from this process: an embedded relay wakes without polling."""
        loop = self._loop
        if loop is None:
            return
        queues = kwargs.get("queues") or ()
        try:
            loop.call_soon_threadsafe(self._woken_by_commit, tuple(queues))
        except RuntimeError:
            pass

    def _woken_by_commit(self, queues: tuple[str, ...]) -> None:
        self._known_queues.update(queues)
        self._wake.set()

    # -- serve -----------------------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """The relay's main loop as a coroutine, for applications that run their own event loop."""
        self._open()
        started = False
        try:
            await self._check_database()
            self._bind_handlers()
            if install_signal_handlers:
                self._install_signals()
            signals.messages_committed.connect(self._on_commit, sender=self.outbox, weak=False)
            self._background = [
                asyncio.create_task(self._writer(), name="outbox-writer"),
                asyncio.create_task(self._heartbeat(), name="outbox-heartbeat"),
                asyncio.create_task(self._recoverer(), name="outbox-recoverer"),
            ]
            if self.listen:
                self.listener = Listener(self.engine, on_notify=self._wake.set, on_listening=self._wake.set)
                self._background.append(asyncio.create_task(self.listener.run(), name="outbox-listen"))
            if self.metrics is not None:
                listener = self.listener
                self.metrics.watch_listener(lambda: listener is None or listener.connected.is_set())
                self.metrics.up.set(1)
                self._background.append(asyncio.create_task(self._refresh_metrics(), name="outbox-metrics"))
            log.info(
                "relay %s started: routes=%s queues=%s concurrency=%d listen=%s",
                self.id,
                ",".join(self._handlers),
                ",".join(self.queues) if self.queues else "*",
                self.concurrency,
                self.listen,
                extra={"action": "start", "relay_id": self.id},
            )
            signals.relay_started.send(self.outbox, relay=self)
            started = True
            await self._serve_loop()
            await self._shutdown()
        finally:
            signals.messages_committed.disconnect(self._on_commit, sender=self.outbox)
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await self._shutdown_handlers()
            await self._close_loop_connections()
            if self.metrics is not None:
                self.metrics.up.set(0)
            if install_signal_handlers:
                self._remove_signals()
            self._close()
            if started:  # also when serving failed: whoever saw it start must see it stop
                log.info("relay %s stopped", self.id, extra={"action": "stopped", "relay_id": self.id})
                signals.relay_stopped.send(self.outbox, relay=self)

    async def _serve_loop(self) -> None:
        failures = 0
        discover = True
        while not self._stopping:
            self._wake.clear()
            try:
                _, more = await self._claim_round(discover=discover)
                failures = 0
                if self.metrics is not None:
                    self.metrics.database_ok()
            except SQLAlchemyError as exc:
                failures += 1
                delay = min(30.0, 0.25 * 2 ** min(failures - 1, 10))
                log.warning(
                    "claim failed (%s); retrying in %.1fs",
                    _first_line(exc),
                    delay,
                    extra={"action": "db_error", "relay_id": self.id, "failures": failures},
                )
                # A LISTEN reconnect (or a stop) cuts the back-off short: the database is back.
                await self._sleep(delay)
                continue
            if more:
                discover = False
                continue
            discover = True
            await self._sleep(self.poll_interval)

    async def _sleep(self, seconds: float, *, wakeable: bool = True) -> None:
        """Wait for a wake-up (or, when backing off from an outage, only for a stop request)."""
        waiter = self._wake if wakeable else self._stop_requested
        try:
            # asyncio.timeout, not wait_for: no extra Task on the commit-to-claim path.
            async with asyncio.timeout(seconds):
                await waiter.wait()
        except TimeoutError:
            pass

    async def _report_unknown_handlers(self) -> None:
        """Rows for routes this relay lacks stay pending (a rolling deploy must not kill them): say so."""
        self._next_unknown_report = time.monotonic() + _UNKNOWN_REPORT_EVERY
        try:
            unknown = await self._db(self.store.waiting_for_unknown_handlers, self._handlers)
        except SQLAlchemyError:
            return
        for name, count in sorted(unknown.items()):
            log.warning(
                "%d pending message(s) wait for route %r, which this relay has no handler for",
                count,
                name,
                extra={"action": "unknown_handler", "handler": name, "count": count},
            )

    # -- claiming and dispatch -------------------------------------------------------------

    def _free(self, queue: str) -> int:
        # Outcomes not yet written hold their slot: if the database falls behind, the
        # relay claims less instead of piling up results in memory.
        free = self.concurrency - len(self._inflight) - len(self._buffer)
        limit = self.queue_concurrency.get(queue)
        if limit is not None:
            free = min(free, limit - self._by_queue[queue])
        return free

    async def _queues_to_claim(self, discover: bool) -> list[str]:
        if self.queues is not None:
            return list(self.queues)
        # Discovery finds queues named only at emit time; once per poll interval is
        # enough, and keeps a query off the wake-up path.
        if discover and time.monotonic() >= self._next_discovery:
            self._next_discovery = time.monotonic() + self.poll_interval
            self._known_queues.update(await self._db(self.store.pending_queues))
        return sorted(self._known_queues)

    async def _claim_round(self, *, discover: bool) -> tuple[int, bool]:
        """Claim from every served queue up to the free slots.

        Returns how many were claimed, and whether more may be due right now
        (a full batch came back and slots are still free).
        """
        more = False
        claimed = 0
        self._saturated = False
        for queue in await self._queues_to_claim(discover):
            if self._stopping:
                break
            free = self._free(queue)
            if free <= 0:
                self._saturated = True
                continue
            limit = min(self.batch_size, free)
            if self._claimer is not None:
                rows = await self.store.claim_on(self._claimer, queue, self._handlers, limit)
            else:
                rows = await self._db(self.store.claim, queue, self._handlers, limit)
            if rows:
                claimed += len(rows)
                self._dispatch(queue, rows)
            if len(rows) == limit:
                more = True
                if self._free(queue) <= 0:
                    self._saturated = True
        return claimed, more and not self._saturated

    def _dispatch(self, queue: str, rows: list[Any]) -> None:
        log.debug(
            "claimed %d from %s",
            len(rows),
            queue,
            extra={"action": "claim", "queue": queue, "count": len(rows)},
        )
        if signals.message_claimed.receivers:
            from .dispatch import to_message

            signals.message_claimed.send(self.outbox, relay=self, messages=[to_message(r) for r in rows])
        for row in rows:
            self._by_queue[queue] += 1
            task = asyncio.create_task(self._deliver(queue, row), name=f"outbox-message-{row.id}")
            self._inflight[row.id, row.attempts] = task

    async def _deliver(self, queue: str, row: Any) -> None:
        try:
            if self._stopping:
                self._unstarted.append(row.id)
                return
            route = self._routes[row.handler]
            try:
                message, completion = await attempt(
                    route, row, executor=self._handler_pool, redactor=self._redactor, rng=self._rng
                )
            except asyncio.CancelledError:
                message, completion = self._cancelled(row)
            except Exception as exc:  # a relay bug must not leave a started attempt without its outcome
                log.error(
                    "attempt of message #%d could not be classified",
                    row.id,
                    exc_info=True,
                    extra={"action": "relay_error", "message_id": row.id, "handler": row.handler},
                )
                message, completion = self._cancelled(row, exc)
            self._buffer.append((message, completion))
            self._buffered.set()
        finally:
            self._inflight.pop((row.id, row.attempts), None)
            self._by_queue[queue] -= 1
            if self._saturated:
                self._wake.set()

    def _cancelled(self, row: Any, error: Exception | None = None) -> tuple[Message, Completion]:
        """A delivery cut off by a forced stop (or a relay error): it counts, like any attempt that may
        have taken effect.

        On its last attempt the message goes dead, as a lease recovery would make it.
        """
        from .dispatch import to_message

        now = utcnow()
        if error is not None:
            last = row.attempts >= row.max_attempts
            return to_message(row), Completion(
                message_id=row.id,
                attempt=row.attempts,
                outcome="dead" if last else "failed",
                status="dead" if last else "pending",
                started_at=now,
                finished_at=now,
                error_type="RelayError",
                error=f"the relay failed while running this attempt ({type(error).__name__})",
                detail={"exhausted": True, "last_outcome": "failed"} if last else None,
            )
        last = row.attempts >= row.max_attempts
        return to_message(row), Completion(
            message_id=row.id,
            attempt=row.attempts,
            outcome="dead" if last else "failed",
            status="dead" if last else "pending",
            started_at=now,
            finished_at=now,
            error_type="Cancelled",
            error="the relay stopped before the handler finished; it may or may not have taken effect",
            detail={"exhausted": True, "last_outcome": "failed"} if last else None,
        )

    # -- writing outcomes ------------------------------------------------------------------

    async def _writer(self) -> None:
        failures = 0
        while True:
            await self._buffered.wait()
            try:
                await self._write_pending()
                failures = 0
            except Exception as exc:
                # Not only database errors: if this task died, outcomes would silently stop being
                # recorded while leases lapse and every message is delivered again and again.
                failures += 1
                delay = min(30.0, 0.25 * 2 ** min(failures - 1, 10))
                log.warning(
                    "could not record %d outcome(s) (%s); retrying in %.1fs",
                    len(self._buffer),
                    _first_line(exc),
                    delay,
                    exc_info=not isinstance(exc, SQLAlchemyError),
                    extra={"action": "db_error", "relay_id": self.id, "failures": failures},
                )
                await asyncio.sleep(delay)

    async def _write_pending(self) -> None:
        async with self._write_lock:
            self._buffered.clear()
            batch, self._buffer = self._buffer, []
            if not batch:
                return
            try:
                try:
                    await self._record([c for _, c in batch])
                except (DataError, IntegrityError, ProgrammingError) as exc:
                    # Not an outage: the database refuses something in this batch. Retrying it
                    # whole would stall every later outcome behind it, so find the culprit.
                    await self._record_one_by_one(batch, exc)
            except BaseException:
                self._buffer[:0] = batch  # keep them, in order, for the next try
                self._buffered.set()
                raise
        if self._saturated:
            self._wake.set()  # the written outcomes freed their slots
        for message, completion in batch:
            self._announce(message, completion)

    async def _record(self, outcomes: list[Completion]) -> None:
        if self._recorder is not None:
            await self.store.complete_on(self._recorder, outcomes)
        else:
            await self._db(self.store.complete, outcomes)

    async def _record_one_by_one(self, batch: list[tuple[Message, Completion]], refused: Exception) -> None:
        """Record each outcome alone; one the database still refuses is recorded without its text.

        Nothing is dropped: the attempt, its outcome and the message's next
        status are kept, and the history says why its error and detail are missing.
        """
        written = 0
        try:
            for index, (message, completion) in enumerate(batch):
                await self._record_alone(batch, index, message, completion)
                written += 1
        except BaseException:
            # An outage halfway: what is written must not be buffered again (its history would
            # be appended twice); the caller keeps the rest, and its list is this one.
            announced = batch[:written]
            del batch[:written]
            for message, completion in announced:
                self._announce(message, completion)
            raise
        log.warning(
            "a batch of %d outcomes was refused (%s) and recorded one by one",
            len(batch),
            _first_line(refused),
            extra={"action": "db_error", "relay_id": self.id},
        )

    async def _record_alone(
        self, batch: list[tuple[Message, Completion]], index: int, message: Message, completion: Completion
    ) -> None:
        """Record one outcome; if the database refuses it, record it without its text instead."""
        try:
            await self._record([completion])
            return
        except (DataError, IntegrityError, ProgrammingError) as exc:
            reason = _first_line(exc)
        log.error(
            "outcome of %s #%d was refused by the database (%s); recording it without its text",
            message.event_type,
            message.id,
            reason,
            extra={"action": "db_error", "message_id": message.id, "handler": message.handler},
        )
        plain = dataclasses.replace(
            completion,
            error_type=None if completion.error_type is None else "UnstorableError",
            error=None if completion.error is None else "the error text could not be stored",
            detail={"unstorable_outcome": reason[:500]},
        )
        batch[index] = (message, plain)
        await self._record([plain])

    def _announce(self, message: Message, completion: Completion) -> None:
        if self.metrics is not None:
            self.metrics.observe(message, completion)
        extra = {
            "relay_id": self.id,
            "message_id": message.id,
            "handler": message.handler,
            "event_type": message.event_type,
            "attempt": message.attempt,
            "outcome": completion.outcome,
        }
        duration = (completion.finished_at - completion.started_at).total_seconds()
        if completion.status == "delivered":
            self._result.delivered += 1
            log.info(
                "delivered %s #%d to %s (attempt %d, %.0f ms)",
                message.event_type,
                message.id,
                message.handler,
                message.attempt,
                duration * 1000,
                extra={"action": "deliver", **extra},
            )
            signals.message_delivered.send(self.outbox, relay=self, message=message, duration=duration)
        elif completion.status == "pending":
            self._result.retried += 1
            log.warning(
                "%s #%d to %s failed (%s: %s); retry in %.1fs",
                message.event_type,
                message.id,
                message.handler,
                completion.outcome,
                completion.error,
                completion.retry_in,
                extra={"action": "retry", **extra},
            )
            signals.retry_scheduled.send(
                self.outbox,
                relay=self,
                message=message,
                outcome=completion.outcome,
                delay=completion.retry_in,
                error=completion.error,
            )
            if self._loop is not None and completion.retry_in < self.poll_interval:
                self._loop.call_later(completion.retry_in, self._wake.set)
        else:
            self._result.dead += 1
            log.error(
                "%s #%d to %s is dead after attempt %d: %s",
                message.event_type,
                message.id,
                message.handler,
                message.attempt,
                completion.error,
                extra={"action": "dead", **extra},
            )
            signals.message_dead.send(self.outbox, relay=self, message=message, error=completion.error)

    async def _refresh_metrics(self) -> None:
        assert self.metrics is not None
        while True:
            try:
                await self._db(self.metrics.refresh, self.engine)
            except SQLAlchemyError as exc:
                log.warning("metrics query failed (%s)", _first_line(exc), extra={"action": "db_error"})
            await asyncio.sleep(self.metrics_interval)

    # -- leases ------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Renew leases of running deliveries so a slow but live handler is never claimed twice."""
        period = max(self.lease / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            # Finished but not yet recorded still counts: the lease must outlive the write.
            ids = list(
                {
                    *(message_id for message_id, _ in self._inflight),
                    *(c.message_id for _, c in self._buffer),
                    *self._unstarted,
                }
            )
            if not ids:
                continue
            try:
                kept = await self._db(self.store.extend, ids)
            except SQLAlchemyError as exc:
                log.warning("lease renewal failed (%s)", _first_line(exc), extra={"action": "db_error"})
                continue
            if kept < len(ids):
                log.warning(
                    "%d of %d leases were lost (expired and recovered by another relay?)",
                    len(ids) - kept,
                    len(ids),
                    extra={"action": "lease_lost", "relay_id": self.id},
                )

    async def _recover_once(self) -> int:
        from .dispatch import to_message

        recovered = await self._db(self.store.recover_expired, self._backoffs, self._rng)
        for item in recovered:
            row = item.row
            log.warning(
                "recovered message #%d from relay %s whose lease expired%s",
                row.id,
                row.locked_by,
                "; it was its last attempt: dead" if item.dead else "",
                extra={
                    "action": "lease_expired",
                    "relay_id": self.id,
                    "message_id": row.id,
                    "handler": row.handler,
                    "event_type": row.event_type,
                    "attempt": row.attempts,
                    "outcome": "lease_expired",
                    "held_by": row.locked_by,
                },
            )
            if self.metrics is not None:
                self.metrics.deliveries.labels(row.handler, "lease_expired").inc()
            message = to_message(row)
            if item.dead:
                signals.message_dead.send(self.outbox, relay=self, message=message, error=item.reason)
            else:
                signals.retry_scheduled.send(
                    self.outbox,
                    relay=self,
                    message=message,
                    outcome="lease_expired",
                    delay=item.retry_in,
                    error=item.reason,
                )
        self._result.recovered += len(recovered)
        if recovered:
            self._wake.set()
        return len(recovered)

    async def _recoverer(self) -> None:
        period = min(max(self.lease / 2, 0.1), 10.0)
        while True:
            try:
                await self._recover_once()
            except SQLAlchemyError as exc:
                log.warning("lease recovery failed (%s)", _first_line(exc), extra={"action": "db_error"})
            if time.monotonic() >= self._next_unknown_report:
                await self._report_unknown_handlers()
            await asyncio.sleep(period)

    # -- shutdown ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        for task in self._background:
            if task.get_name() in ("outbox-listen", "outbox-recoverer"):
                task.cancel()
        # Deliveries claimed in the same round as the stop find it when they first run; hand
        # them back now, not after the grace period, so another relay can take them at once.
        await asyncio.sleep(0)
        await self._release_unstarted(raise_errors=False)
        inflight = list(self._inflight.values())
        if inflight:
            log.info(
                "waiting up to %.0fs for %d in-flight deliveries",
                self.grace_period,
                len(inflight),
                extra={"action": "drain", "relay_id": self.id},
            )
            forced: asyncio.Task[Any] = asyncio.create_task(self._force.wait())
            everything: asyncio.Future[Any] = asyncio.gather(*inflight, return_exceptions=True)
            await asyncio.wait(
                [forced, everything], timeout=self.grace_period, return_when=asyncio.FIRST_COMPLETED
            )
            forced.cancel()
            late = [t for t in inflight if not t.done()]
            for task in late:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            if late:
                log.warning(
                    "cancelled %d deliveries still running at shutdown; they will be retried",
                    len(late),
                    extra={"action": "cancel", "relay_id": self.id},
                )
        await self._final_writes()

    async def _release_unstarted(self, *, raise_errors: bool = True) -> None:
        """Hand back claimed messages whose delivery never began: no attempt, no history."""
        if not self._unstarted:
            return
        try:
            released = await self._db(self.store.release, self._unstarted)
        except SQLAlchemyError:
            if raise_errors:
                raise
            return  # kept in _unstarted (their leases renewed) for the final writes to retry
        log.info("released %d unstarted message(s)", released, extra={"action": "release"})
        self._unstarted = []

    async def _final_writes(self) -> None:
        deadline = time.monotonic() + max(5.0, min(self.grace_period, 30.0))
        while True:
            try:
                await self._release_unstarted()
                await self._write_pending()
                return
            except SQLAlchemyError as exc:
                if time.monotonic() > deadline:
                    log.error(
                        "giving up recording %d outcome(s) at shutdown (%s); their leases will expire "
                        "and they will be delivered again",
                        len(self._buffer) + len(self._unstarted),
                        _first_line(exc),
                        extra={"action": "db_error", "relay_id": self.id},
                    )
                    return
                await asyncio.sleep(0.5)

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, True)

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    # -- drain -------------------------------------------------------------------------------

    async def drain(self) -> DrainResult:
        """Deliver what is due, including retries that fall due while draining, then return.

        Errors reaching the database are raised, not retried: a script or test
        asking "deliver everything now" wants to know.
        """
        self._open()
        try:
            await self._check_database()
            self._bind_handlers()
            await self._report_unknown_handlers()
            await self._recover_once()
            self._background = [asyncio.create_task(self._heartbeat(), name="outbox-heartbeat")]
            while True:
                # Write first, then claim: a claim must see every outcome so far,
                # or a group's next message looks blocked by one already finished.
                await self._write_pending()
                claimed, _ = await self._claim_round(discover=True)
                if self._inflight:
                    await asyncio.wait(set(self._inflight.values()), return_when=asyncio.FIRST_COMPLETED)
                    continue
                if not claimed and not self._buffer:
                    break
        finally:
            pending = [*self._inflight.values(), *self._background]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._save_what_is_left()
            await self._shutdown_handlers()
            await self._close_loop_connections()
            self._close()
        return self._result

    async def _save_what_is_left(self) -> None:
        """After an interrupted drain: record cancelled attempts, hand back whatever never started.

        Every delivery that began has an outcome by now (cancelled ones too), so
        once those are written, any row still running under this relay's id was
        claimed but never started (the interrupt came mid-claim, or before its
        task ran): it goes back untouched. One try only: if the database is what
        failed, the leases expire and the messages are recovered as usual.
        """
        self._unstarted = []
        try:
            await self._write_pending()
            released = await self._db(self.store.release, None)
            if released:
                log.info("released %d unstarted message(s)", released, extra={"action": "release"})
        except Exception as exc:
            log.warning(
                "could not record %d outcome(s) of the interrupted drain (%s); their leases will expire",
                len(self._buffer) + len(self._unstarted),
                _first_line(exc),
                extra={"action": "db_error", "relay_id": self.id},
            )
