"""The relay: one :class:`Relay` composing the parts that claim, deliver, record, keep leases and stop.

Each long-running job has an owner of its own, with its own state:

- :class:`~outbox.relay.claimer.Claimer` (``claimer.py``): claim rounds, one
  delivery task per claimed message, delivery slots per queue;
- :class:`~outbox.relay.writer.OutcomeWriter` (``writer.py``): outcomes written
  back in batches, then announced;
- :class:`~outbox.relay.leases.LeaseKeeper` (``leases.py``): the heartbeat that
  renews this relay's leases, the recoverer that takes back lapsed ones;
- :class:`~outbox.relay.shutdown.Shutdown` (``shutdown.py``): the stop sequence
  and the end of an interrupted drain;
- :class:`~outbox.relay.db.Listener` (``db.py``): LISTEN/NOTIFY wake-ups;
- :class:`~outbox.relay.registry.Registry` (``registry.py``): this relay's row
  in ``outbox_relay_registry``, for operators and dashboards.

They share a :class:`~outbox.relay.runtime.Runtime` (settings, wake-up events,
the database threads), made afresh each time the relay serves or drains. This
module only wires them together and runs the serve loop.

One asyncio loop owns all state. Database calls are short synchronous
SQLAlchemy statements (``store``) run on a small thread pool; handlers run on
the loop (``async def``) or on daemon threads (plain functions). Nothing here
trusts the LISTEN connection: wake-ups make the relay claim sooner, and the
poll interval makes it claim anyway.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import SQLAlchemyError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import ConfigurationError, Outbox, signals
from outbox._ops_relays import REGISTRY_PERIOD
from outbox._redact import Redactor
from outbox._routes import check_name

from .announce import send
from .claimer import Claimer
from .db import Listener, make_engine, supports_listen
from .dispatch import secrets_of
from .hooks import bind_handlers, shutdown_handlers, start_handlers
from .leases import LeaseKeeper
from .metrics import RelayMetrics
from .registry import Registry
from .runtime import DrainResult, Runtime, backoff_delay, first_line, log, supervise
from .settings import DEFAULT_CONCURRENCY, default_relay_id, positive, queue_caps, queue_names
from .shutdown import Shutdown
from .startup import DatabaseUnavailable, check_database
from .store import GroupPolicy, Store
from .writer import OutcomeWriter

# DatabaseUnavailable and DEFAULT_CONCURRENCY are imported from here by earlier code.
__all__ = ["DEFAULT_CONCURRENCY", "DatabaseUnavailable", "DrainResult", "Relay"]


class Relay:
    """Delivers committed outbox messages to the handlers an :class:`~outbox.Outbox` routes them to.

    ``run()`` serves until stopped (SIGTERM/SIGINT when ``install_signal_handlers``
    is set, or :meth:`stop` from any thread); ``run_until_idle()`` delivers what is
    due and returns, for tests, scripts and ``outbox-relay --once``.

    ``database`` is an Engine, an ``AsyncEngine`` or a URL. An async one
    (asyncpg, psycopg's async mode, aiosqlite) is served through the matching
    synchronous driver, connecting with the same settings (see ``outbox._urls``).
    """

    def __init__(
        self,
        outbox: Outbox,
        database: Engine | AsyncEngine | str | URL,
        *,
        queues: Iterable[str] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
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
        registry_interval: float = REGISTRY_PERIOD,
    ) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigurationError(f"Relay needs an outbox.Outbox, got {outbox!r}")
        if not outbox.routes:
            raise ConfigurationError("the Outbox has no routes: a relay would have nothing to deliver")
        self.outbox = outbox
        self.concurrency: int = positive("concurrency", concurrency, integer=True)
        self.batch_size: int = positive(
            "batch_size", batch_size if batch_size is not None else concurrency, integer=True
        )
        self.poll_interval: float = positive("poll_interval", poll_interval)
        self.lease: float = positive("lease", lease)
        self.grace_period: float = positive("grace_period", grace_period, zero=True)
        if group_policy not in ("block", "skip"):
            raise ConfigurationError(f"group_policy must be 'block' or 'skip', got {group_policy!r}")
        self.queues = queue_names(queues)
        self.queue_concurrency = queue_caps(queue_concurrency)
        self.id = check_name("relay_id", relay_id) if relay_id is not None else default_relay_id()
        self.engine = make_engine(database)
        self._owns_engine = self.engine is not database
        self.listen = listen and supports_listen(self.engine)
        self.store = Store(self.engine, self.id, lease=self.lease, group_policy=group_policy)
        self._routes = {r.name: r for r in outbox.routes}
        self._redactor = Redactor(secrets_of(r.handler for r in outbox.routes))
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rt: Runtime | None = None
        self._stop_lock = threading.Lock()
        self._early_stop: bool | None = None  # a stop() that came before the loop ran
        self.listener: Listener | None = None
        self.metrics = metrics
        self.metrics_interval: float = positive("metrics_interval", metrics_interval)
        # Readers (outbox.ops.relays) call a relay dead after three periods without a write.
        self.registry_interval: float = positive("registry_interval", registry_interval)
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

    def _open(self) -> Runtime:
        """Make this run's runtime and collaborators; the relay object itself is reusable."""
        rt = Runtime(
            self,
            outbox=self.outbox,
            store=self.store,
            routes=self._routes,
            redactor=self._redactor,
            rng=self._rng,
            metrics=self.metrics,
            poll_interval=self.poll_interval,
        )
        self._rt = rt
        self._writer = OutcomeWriter(rt)
        self._claimer = Claimer(
            rt,
            self._writer,
            queues=self.queues,
            concurrency=self.concurrency,
            queue_concurrency=self.queue_concurrency,
            batch_size=self.batch_size,
        )
        self._leases = LeaseKeeper(
            rt, lease=self.lease, held_ids=lambda: [*self._claimer.held_ids(), *self._writer.held_ids()]
        )
        self._shutdown = Shutdown(rt, self._claimer, self._writer, grace_period=self.grace_period)
        self._registry = Registry(
            rt,
            engine=self.engine,
            queues=self.queues,
            period=self.registry_interval,
            in_flight=lambda: len(self._claimer.inflight),
        )
        self._background: list[asyncio.Task[Any]] = []
        with self._stop_lock:
            self._loop = rt.loop
            early, self._early_stop = self._early_stop, None
        if early is not None:
            rt.request_stop(early)
        return rt

    async def _close(self, rt: Runtime) -> None:
        await self._claimer.close()
        await self._writer.close()
        rt.close()
        if self._owns_engine:
            self.engine.dispose()
        with self._stop_lock:
            self._loop = None

    @property
    def listening(self) -> bool:
        """True from each ``relay_listening`` signal until the LISTEN connection is lost."""
        return self.listener is not None and self.listener.connected.is_set()

    def _now_listening(self, rt: Runtime) -> None:
        rt.wake.set()  # the catch-up claim: a NOTIFY sent while not listening was lost
        send(signals.relay_listening, self.outbox, relay=self)

    def _request_stop(self, graceful: bool) -> None:
        if self._rt is not None:
            self._rt.request_stop(graceful)

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
        if self._rt is not None:
            self._claimer.learn_queues(queues)
            self._rt.wake.set()

    # -- serve -----------------------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """The relay's main loop as a coroutine, for applications that run their own event loop."""
        rt = self._open()
        started = False
        try:
            await check_database(rt, self.engine)
            bind_handlers(self._routes.values(), self.engine)
            await self._start_handlers()
            if install_signal_handlers:
                self._install_signals()
            signals.messages_committed.connect(self._on_commit, sender=self.outbox, weak=False)
            self._background = [
                self._start("outbox-writer", self._writer.run),
                self._start("outbox-heartbeat", self._leases.heartbeat),
                self._start("outbox-recoverer", self._leases.recoverer),
                self._start("outbox-registry", self._registry.run),
            ]
            if self.listen:
                self.listener = Listener(
                    self.engine, on_notify=rt.wake.set, on_listening=lambda: self._now_listening(rt)
                )
                self._background.append(self._start("outbox-listen", self.listener.run))
            if self.metrics is not None:
                # Ready means listening in the sense relay_listening announces (or not listening at all).
                self.metrics.watch_listener(lambda: not self.listen or self.listening)
                self.metrics.up.set(1)
                self._background.append(self._start("outbox-metrics", lambda: self._refresh_metrics(rt)))
            log.info(
                "relay %s started: routes=%s queues=%s concurrency=%d listen=%s",
                self.id,
                ",".join(rt.handlers),
                ",".join(self.queues) if self.queues else "*",
                self.concurrency,
                self.listen,
                extra={"action": "start", "relay_id": self.id},
            )
            send(signals.relay_started, self.outbox, relay=self)
            started = True
            await self._serve_loop(rt)
            await self._shutdown.graceful(self._background)
            await self._registry.stopped(self._background)
        finally:
            signals.messages_committed.disconnect(self._on_commit, sender=self.outbox)
            for task in self._background:
                task.cancel()
            await asyncio.gather(*self._background, return_exceptions=True)
            await shutdown_handlers(self._routes.values(), self._redactor)
            if self.metrics is not None:
                self.metrics.up.set(0)
            if install_signal_handlers:
                self._remove_signals()
            await self._close(rt)
            if started:  # also when serving failed: whoever saw it start must see it stop
                log.info("relay %s stopped", self.id, extra={"action": "stopped", "relay_id": self.id})
                send(signals.relay_stopped, self.outbox, relay=self)

    async def _start_handlers(self) -> None:
        """``outbox_start`` hooks; a ConfigurationError from one means this relay does not start."""
        await start_handlers(
            self._routes.values(), self._redactor, lease=self.lease, poll_interval=self.poll_interval
        )

    def _start(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A background task that is restarted, loudly, if it ever fails or ends."""
        return asyncio.create_task(supervise(name, run, relay_id=self.id), name=name)

    async def _serve_loop(self, rt: Runtime) -> None:
        failures = 0
        discover = True
        while not rt.stopping:
            rt.wake.clear()
            try:
                _, more = await self._claimer.claim_round(discover=discover)
                failures = 0
                if self.metrics is not None:
                    self.metrics.database_ok()
            except SQLAlchemyError as exc:
                failures += 1
                delay = backoff_delay(failures)
                log.warning(
                    "claim failed (%s); retrying in %.1fs",
                    first_line(exc),
                    delay,
                    extra={"action": "db_error", "relay_id": self.id, "failures": failures},
                )
                # A LISTEN reconnect (or a stop) cuts the back-off short: the database is back.
                await rt.sleep(delay)
                continue
            if more:
                discover = False
                continue
            discover = True
            await rt.sleep(self.poll_interval)

    async def _refresh_metrics(self, rt: Runtime) -> None:
        assert self.metrics is not None
        while True:
            try:
                await rt.db(self.metrics.refresh, self.engine)
            except SQLAlchemyError as exc:
                log.warning("metrics query failed (%s)", first_line(exc), extra={"action": "db_error"})
            await asyncio.sleep(self.metrics_interval)

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
        rt = self._open()
        claimer, writer = self._claimer, self._writer
        try:
            await check_database(rt, self.engine)
            bind_handlers(self._routes.values(), self.engine)
            await self._start_handlers()
            await self._leases.report_unknown_handlers()
            await self._leases.recover_once()
            self._background = [self._start("outbox-heartbeat", self._leases.heartbeat)]
            # The same pipeline as serving: outcomes are written by their own task while the
            # next batch is claimed and delivered, so a drain runs as fast as a serving relay.
            writing = asyncio.create_task(writer.run(retry=False), name="outbox-writer")
            self._background.append(writing)
            while True:
                # Idle before the claim, nothing claimed by it: every outcome so far was in the
                # database when it ran, so nothing due is left (a finished message unblocks
                # its group's next one only once written).
                idle = not claimer.inflight and writer.idle
                rt.wake.clear()
                claimed, more = await claimer.claim_round(discover=True)
                if idle and not claimed:
                    break
                if more:
                    continue
                # Woken by a finished delivery or a written batch; a failed write ends the drain.
                waking = asyncio.create_task(rt.wake.wait())
                await asyncio.wait((waking, writing), return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
                if writing.done():
                    writing.result()  # raises the write's error
                    raise RuntimeError("the outcome writer stopped during a drain")
        finally:
            pending = [*claimer.inflight.values(), *self._background]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._shutdown.end_of_drain()
            await shutdown_handlers(self._routes.values(), self._redactor)
            await self._close(rt)
        return rt.result
