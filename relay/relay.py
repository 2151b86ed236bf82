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

They share a :class:`~outbox.relay.run_context.RunContext` (``run_context.py``:
settings, wake-up events, the database threads). A
:class:`~outbox.relay.run.RelayRun` (``run.py``) makes them afresh each time the
relay serves or drains, and runs the serve loop or the drain. This module checks
the relay's settings once, into the :class:`~outbox.relay.settings.RelaySettings`
(``settings.py``) every run is made from, and holds the ways to start and stop it.

One asyncio loop owns all state. Database calls are short synchronous
SQLAlchemy statements (``store``) run on a small thread pool; handlers run on
the loop (``async def``) or on daemon threads (plain functions). Nothing here
trusts the LISTEN connection: wake-ups make the relay claim sooner, and the
poll interval makes it claim anyway.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import URL, Engine

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import ConfigurationError, Outbox, Route, signals
from outbox._redact import Redactor
from outbox._routes import check_name
from outbox.ops._relays import REGISTRY_PERIOD

from .db import Listener, make_engine, supports_listen
from .dispatch import secrets_of
from .metrics import RelayMetrics
from .run import RelayRun
from .run_context import DrainResult
from .settings import DEFAULT_CONCURRENCY, RelaySettings, default_relay_id, positive, queue_caps, queue_names
from .startup import DatabaseUnavailable
from .store import GroupPolicy, Store

# DatabaseUnavailable and DEFAULT_CONCURRENCY: earlier code imported them from the module that owns Relay.
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
        concurrency = positive("concurrency", concurrency, integer=True)
        batch_size = positive(
            "batch_size", batch_size if batch_size is not None else concurrency, integer=True
        )
        poll_interval = positive("poll_interval", poll_interval)
        lease = positive("lease", lease)
        grace_period = positive("grace_period", grace_period, zero=True)
        if group_policy not in ("block", "skip"):
            raise ConfigurationError(f"group_policy must be 'block' or 'skip', got {group_policy!r}")
        queues = queue_names(queues)
        queue_concurrency = queue_caps(queue_concurrency)
        relay_id = check_name("relay_id", relay_id) if relay_id is not None else default_relay_id()
        engine = make_engine(database)
        self._owns_engine = engine is not database
        listen = listen and supports_listen(engine)
        store = Store(engine, relay_id, lease=lease, group_policy=group_policy)
        routes = {r.name: r for r in outbox.routes}
        redactor = Redactor(secrets_of(r.handler for r in outbox.routes))
        rng = random.Random(seed)
        metrics_interval = positive("metrics_interval", metrics_interval)
        # Readers (outbox.ops.relays) call a relay dead after three periods without a write.
        registry_interval = positive("registry_interval", registry_interval)
        self.settings = RelaySettings(
            id=relay_id,
            outbox=outbox,
            engine=engine,
            store=store,
            routes=routes,
            redactor=redactor,
            rng=rng,
            metrics=metrics,
            queues=queues,
            concurrency=concurrency,
            queue_concurrency=queue_concurrency,
            batch_size=batch_size,
            poll_interval=poll_interval,
            lease=lease,
            grace_period=grace_period,
            listen=listen,
            metrics_interval=metrics_interval,
            registry_interval=registry_interval,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._run: RelayRun | None = None
        self._stop_lock = threading.Lock()
        self._early_stop: bool | None = None  # a stop() that came before the loop ran
        if metrics is not None:
            for route in outbox.routes:
                states = getattr(route.handler, "outbox_breaker_states", None)
                if callable(states):
                    metrics.watch_breakers(states)

    def __repr__(self) -> str:
        return f"<Relay {self.id} routes={len(self.routes)}>"

    # -- read by applications and tests ----------------------------------------------------

    @property
    def id(self) -> str:
        return self.settings.id

    @property
    def outbox(self) -> Outbox:
        return self.settings.outbox

    @property
    def engine(self) -> Engine:
        return self.settings.engine

    @property
    def store(self) -> Store:
        return self.settings.store

    @property
    def routes(self) -> dict[str, Route]:
        return self.settings.routes

    @property
    def metrics(self) -> RelayMetrics | None:
        return self.settings.metrics

    @property
    def listen(self) -> bool:
        """Whether runs LISTEN: asked for, and possible on this engine (PostgreSQL with psycopg 3)."""
        return self.settings.listen

    @property
    def listener(self) -> Listener | None:
        """The LISTEN connection of the current run, or of the last one; a run owns its listener."""
        run = self._run
        return run.listener if run is not None else None

    @property
    def listening(self) -> bool:
        """True from each ``relay_listening`` signal until the LISTEN connection is lost."""
        run = self._run
        return run is not None and run.listening

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

    def _open(self) -> RelayRun:
        """Make this run's parts; the relay object itself is reusable."""
        run = RelayRun(self.settings, sender=self, on_close=self._closed)
        self._run = run
        with self._stop_lock:
            self._loop = run.rt.loop
            early, self._early_stop = self._early_stop, None
        if early is not None:
            run.rt.request_stop(early)
        return run

    def _closed(self) -> None:
        if self._owns_engine:
            self.settings.engine.dispose()
        with self._stop_lock:
            self._loop = None

    def _request_stop(self, graceful: bool) -> None:
        if self._run is not None:
            self._run.rt.request_stop(graceful)

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
        if self._run is not None:
            self._run.woken_by_commit(queues)

    # -- serve and drain ---------------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        """The relay's main loop as a coroutine, for applications that run their own event loop."""
        run = self._open()
        signals.messages_committed.connect(self._on_commit, sender=self.outbox, weak=False)
        try:
            await run.serve(install_signal_handlers=install_signal_handlers)
        finally:
            signals.messages_committed.disconnect(self._on_commit, sender=self.outbox)

    async def drain(self) -> DrainResult:
        """Deliver what is due, including retries that fall due while draining, then return.

        Errors reaching the database are raised, not retried: a script or test
        asking "deliver everything now" wants to know.
        """
        return await self._open().drain()
