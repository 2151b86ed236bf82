"""One serve or one drain of a relay: the parts that live for that run, and its loop.

A :class:`~outbox.relay.relay.Relay` is reusable: it may serve, stop and
serve again, or drain many times. Everything a run builds (the run context, the
claimer, the writer, the lease keeper, the shutdown sequence, the registry
row, the LISTEN connection, the background tasks) belongs to a
:class:`RelayRun` and ends with it, so the Relay itself keeps only its settings
and the way to stop it. A run reads those settings from the
:class:`~outbox.relay.settings.RelaySettings` it is given, never from the Relay.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from outbox import signals

from .announce import send
from .breakers import SharedBreakers
from .claimer import Claimer
from .db import Listener
from .hooks import bind_handlers, shutdown_handlers, start_handlers
from .leases import LeaseKeeper
from .registry import Registry
from .run_context import DrainResult, RunContext, backoff_delay, first_line, log, supervise
from .settings import RelaySettings
from .shutdown import Shutdown
from .startup import check_database
from .writer import OutcomeWriter

__all__ = ["RelayRun"]


class RelayRun:
    """The collaborators of one run, wired together; ``serve()`` or ``drain()`` uses them once."""

    def __init__(self, settings: RelaySettings, *, sender: object, on_close: Callable[[], None]) -> None:
        self.settings = settings
        # The Relay, only ever passed on as signals' relay=: typed object, so a run never reads the Relay.
        self.sender = sender
        self._on_close = on_close  # the relay's own clean-up, after this run's parts are closed
        self.rt = rt = RunContext(settings, sender=sender)
        self.writer = OutcomeWriter(rt)
        self.claimer = claimer = Claimer(
            rt,
            self.writer,
            queues=settings.queues,
            concurrency=settings.concurrency,
            queue_concurrency=settings.queue_concurrency,
            batch_size=settings.batch_size,
            listening=lambda: self.listening,
        )
        self.leases = LeaseKeeper(
            rt,
            lease=settings.lease,
            held_ids=lambda: [*claimer.held_ids(), *self.writer.held_ids()],
            on_recovered=claimer.rewind,
        )
        self.shutdown = Shutdown(rt, claimer, self.writer, grace_period=settings.grace_period)
        self.registry = Registry(
            rt,
            engine=settings.engine,
            queues=settings.queues,
            period=settings.registry_interval,
            in_flight=lambda: len(claimer.inflight),
        )
        self.breakers = SharedBreakers(rt, settings.engine)
        self.listener: Listener | None = None  # made when serving, if the relay listens
        self.background: list[asyncio.Task[Any]] = []

    @property
    def listening(self) -> bool:
        """True from each ``relay_listening`` signal until the LISTEN connection is lost."""
        return self.listener is not None and self.listener.connected.is_set()

    def woken_by_commit(self, queues: tuple[str, ...]) -> None:
        """A commit in this process named these queues: claim now, from them too."""
        self.claimer.learn_queues(queues)
        self.rt.wake.set()

    # -- serve -----------------------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool) -> None:
        settings, rt = self.settings, self.rt
        started = False
        try:
            await self._start()
            if install_signal_handlers:
                _install_signals(rt)
            self.background = [
                self._task("outbox-writer", self.writer.run),
                self._task("outbox-heartbeat", self.leases.heartbeat),
                self._task("outbox-recoverer", self.leases.recoverer),
                self._task("outbox-registry", self.registry.run),
            ]
            if settings.listen:
                self.listener = Listener(
                    settings.engine, on_notify=self.claimer.heard, on_listening=self._now_listening
                )
                self.background.append(self._task("outbox-listen", self.listener.run))
            if settings.metrics is not None:
                # Ready means listening in the sense relay_listening announces (or not listening at all).
                settings.metrics.watch_listener(lambda: not settings.listen or self.listening)
                settings.metrics.up.set(1)
                self.background.append(self._task("outbox-metrics", self._refresh_metrics))
            log.info(
                "relay %s started: routes=%s queues=%s concurrency=%d listen=%s",
                settings.id,
                ",".join(rt.handlers),
                ",".join(settings.queues) if settings.queues else "*",
                settings.concurrency,
                settings.listen,
                extra={"action": "start", "relay_id": settings.id},
            )
            send(signals.relay_started, settings.outbox, relay=self.sender)
            started = True
            await self._serve_loop()
            await self.shutdown.graceful(self.background)
            await self.registry.stopped(self.background)
        finally:
            for task in self.background:
                task.cancel()
            await asyncio.gather(*self.background, return_exceptions=True)
            await shutdown_handlers(settings.routes.values(), settings.redactor)
            if settings.metrics is not None:
                settings.metrics.up.set(0)
            if install_signal_handlers:
                _remove_signals()
            await self._close()
            if started:  # also when serving failed: whoever saw it start must see it stop
                log.info(
                    "relay %s stopped", settings.id, extra={"action": "stopped", "relay_id": settings.id}
                )
                send(signals.relay_stopped, settings.outbox, relay=self.sender)

    async def _start(self) -> None:
        """The database check, the handlers' bind and start hooks (``hooks.py`` says what stops it), then
        the shared circuit breakers (``breakers.py``)."""
        settings = self.settings
        await check_database(self.rt, settings.engine)
        await self.leases.history_partitions()
        bind_handlers(settings.routes.values(), settings.engine, settings.redactor)
        await start_handlers(
            settings.routes.values(),
            settings.redactor,
            lease=settings.lease,
            poll_interval=settings.poll_interval,
        )
        await self.breakers.start(settings.routes.values(), settings.redactor)

    def _task(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A background task that is restarted, loudly, if it ever fails or ends."""
        return asyncio.create_task(supervise(name, run, relay_id=self.settings.id), name=name)

    def _now_listening(self) -> None:
        # The catch-up claim, from the front: a NOTIFY sent while not listening was lost.
        self.claimer.rewind()
        self.rt.wake.set()
        send(signals.relay_listening, self.settings.outbox, relay=self.sender)

    async def _serve_loop(self) -> None:
        rt, metrics = self.rt, self.settings.metrics
        failures = 0
        discover = True
        while not rt.stopping:
            rt.wake.clear()
            try:
                _, more = await self.claimer.claim_round(discover=discover)
                failures = 0
                if metrics is not None:
                    metrics.database_ok()
            except SQLAlchemyError as exc:
                failures += 1
                delay = backoff_delay(failures)
                log.warning(
                    "claim failed (%s); retrying in %.1fs",
                    first_line(exc),
                    delay,
                    extra={"action": "db_error", "relay_id": rt.id, "failures": failures},
                )
                # A LISTEN reconnect (or a stop) cuts the back-off short: the database is back.
                await rt.sleep(delay)
                continue
            if more:
                discover = False
                continue
            discover = True
            await rt.sleep(self.settings.poll_interval)

    async def _refresh_metrics(self) -> None:
        settings = self.settings
        assert settings.metrics is not None
        while True:
            try:
                await self.rt.db(settings.metrics.refresh, settings.engine)
            except SQLAlchemyError as exc:
                log.warning("metrics query failed (%s)", first_line(exc), extra={"action": "db_error"})
            await asyncio.sleep(settings.metrics_interval)

    # -- drain -------------------------------------------------------------------------------

    async def drain(self) -> DrainResult:
        settings, rt, claimer, writer = self.settings, self.rt, self.claimer, self.writer
        try:
            await self._start()
            await self.leases.report_unknown_handlers()
            await self.leases.recover_once()
            self.background = [self._task("outbox-heartbeat", self.leases.heartbeat)]
            # The same pipeline as serving: outcomes are written by their own task while the
            # next batch is claimed and delivered, so a drain runs as fast as a serving relay.
            writing = asyncio.create_task(writer.run(retry=False), name="outbox-writer")
            self.background.append(writing)
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
            pending = [*claimer.tasks(), *self.background]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self.shutdown.end_of_drain()
            await shutdown_handlers(settings.routes.values(), settings.redactor)
            await self._close()
        return rt.result

    async def _close(self) -> None:
        await self.breakers.stop()  # what the breakers decided last is written before the engine goes
        await self.claimer.close()
        await self.writer.close()
        self.rt.close()
        self._on_close()


def _install_signals(rt: RunContext) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.request_stop, True)


def _remove_signals() -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
