"""``Consumer``: runs an inbox's sources until told to stop, the way ``outbox-relay`` runs a relay.

Each source runs under a supervisor: an error it lets out (a broker that
refused the connection at start-up, a bug) is logged in one line and the
source is started again after a pause that doubles up to 30 s, so a broker's
outage never ends the process. A :class:`~outbox.ConfigurationError` is the
exception: the configuration will not get better by waiting, so the consumer
stops and says why.

Stopping (SIGTERM, SIGINT, :meth:`Consumer.stop`): the sources stop fetching
and finish the messages in hand within ``grace_period``; a second signal, or
the end of the grace period, cancels them. A message cancelled between its
commit and its acknowledgement comes again and is answered as a duplicate: a
forced stop costs redeliveries, never a second effect.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from sqlalchemy import create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from outbox import ConfigurationError, Inbox, OutboxError, Processed, enable_sqlite_savepoints, outbox_inbox
from outbox._backoff import Backoff
from outbox._first_line import first_line
from outbox._inbox.sessions import Sessions
from outbox._inbox.source import InboxSource
from outbox._migrations import missing_outbox_table

from .context import Runtime, SourceRun
from .metrics import ConsumerMetrics

__all__ = ["Consumer", "ConsumerUnavailable"]

log = logging.getLogger("outbox.consumer")

DEFAULT_CONCURRENCY = 8
#: Longest pause before a failed source is started again.
MAX_RESTART_DELAY = 30.0
#: How often the consumer takes up requeued dead letters (and so checks its database, for /readyz).
HOUSEKEEPING_INTERVAL = 2.0
#: The ``source`` label of requeued dead letters in the metrics.
REQUEUED = "requeued"


class ConsumerUnavailable(OutboxError):
    """The consumer could not reach its database, or the inbox's tables are missing, at start-up."""


def _check_inbox(inbox: Inbox, sources: tuple[InboxSource, ...]) -> None:
    if not isinstance(inbox, Inbox):
        raise ConfigurationError(f"a Consumer runs an outbox.Inbox, got {type(inbox).__name__}")
    if not sources:
        raise ConfigurationError(
            f"inbox {inbox.name!r} has no sources: attach them with inbox.consume(RabbitMQConsumer(...), ...)"
        )
    for handler in inbox.handlers:
        if handler.is_async:
            raise ConfigurationError(
                f"inbox {inbox.name!r}: handler {handler.name!r} is a coroutine function; the consumer "
                "runs handlers in worker threads, in the message's transaction: make it a plain function"
            )


def _probe(sessions: Sessions) -> None:
    from outbox._inbox.sessions import open_session

    with open_session(sessions) as session:
        session.execute(select(outbox_inbox.c.message_id).limit(0))


class Consumer:
    """Runs ``inbox``'s sources, taking each message through ``inbox.process`` in a worker thread.

    ``database`` is a SQLAlchemy URL (the consumer makes its engine, with a
    pool as large as ``concurrency``, and installs ``inbox.outbox`` on its
    sessionmaker), or the application's own sessionmaker or Engine.
    ``concurrency`` is how many messages are processed at once, and each
    source's prefetch. ``retry_backoff`` spaces the redeliveries of a message
    whose handler failed.
    """

    def __init__(
        self,
        inbox: Inbox,
        database: str | Sessions,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        grace_period: float = 30.0,
        retry_backoff: Backoff | None = None,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        sources = inbox.sources if isinstance(inbox, Inbox) else ()
        _check_inbox(inbox, sources)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(f"concurrency must be an int of at least 1, got {concurrency!r}")
        if not isinstance(grace_period, int | float) or grace_period < 0:
            raise ConfigurationError(f"grace_period must be seconds >= 0, got {grace_period!r}")
        self.inbox = inbox
        self.sources = sources
        self.concurrency = concurrency
        self.grace_period = float(grace_period)
        self.backoff = retry_backoff or Backoff(base=1.0, cap=60.0)
        self.metrics = metrics
        self._engine: Engine | None = None
        if isinstance(database, str):
            self._engine = create_engine(database, pool_size=concurrency, max_overflow=2, pool_pre_ping=True)
            # SQLite: concurrent consumers queue for the write lock instead of failing at once.
            enable_sqlite_savepoints(self._engine, wal=False)
            made: sessionmaker[Any] = sessionmaker(self._engine)
            if inbox.outbox is not None:
                inbox.outbox.install(made)
            self.sessions: Sessions = made
        else:
            self.sessions = database
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runtime: Runtime | None = None
        self._force: asyncio.Event | None = None
        self._fatal: BaseException | None = None

    # -- control ------------------------------------------------------------------------------------

    def run(self, *, install_signal_handlers: bool = False) -> None:
        """Serve until stopped; SIGTERM and SIGINT stop it when ``install_signal_handlers``."""
        asyncio.run(self.serve(install_signal_handlers=install_signal_handlers))

    def stop(self) -> None:
        """Ask a running consumer to stop (a second call cancels what is in hand); any thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._signalled)

    def _signalled(self) -> None:
        rt = self._runtime
        if rt is None:
            return
        if rt.stopping.is_set():
            if self._force is not None:
                self._force.set()
            return
        log.info("stopping: no new messages are fetched", extra={"action": "stopping"})
        rt.stopping.set()

    # -- serving ------------------------------------------------------------------------------------

    async def serve(self, *, install_signal_handlers: bool = False) -> None:
        rt = Runtime(
            self.inbox,
            self.sessions,
            concurrency=self.concurrency,
            backoff=self.backoff,
            metrics=self.metrics,
        )
        self._runtime, self._force, self._loop = rt, asyncio.Event(), asyncio.get_running_loop()
        if self.metrics is not None:  # not ready until every source says it is connected
            for source in self.sources:
                self.metrics.source_connected(self.inbox.name, source.name, False)
        try:
            await self._check_database(rt)
            if install_signal_handlers:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self._loop.add_signal_handler(signum, self._signalled)
            if self.metrics is not None:
                self.metrics.up.set(1)
            log.info(
                "inbox %s consuming from %s",
                self.inbox.name,
                ", ".join(source.name for source in self.sources),
                extra={"action": "start", "inbox": self.inbox.name},
            )
            await self._serve(rt)
        finally:
            if install_signal_handlers and self._loop is not None:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(signum)
            if self.metrics is not None:
                self.metrics.up.set(0)
            rt.executor.shutdown(wait=True)  # a transaction in a thread finishes: never cut mid-commit
            if self._engine is not None:
                self._engine.dispose()
            self._runtime = None
        if self._fatal is not None:
            raise self._fatal

    async def _check_database(self, rt: Runtime) -> None:
        try:
            await rt.in_thread(_probe, self.sessions)
        except SQLAlchemyError as exc:
            missing = missing_outbox_table(exc)
            if missing is not None:
                raise ConsumerUnavailable(
                    f"the inbox's tables are missing (no {missing}): "
                    "run `outbox migrate --database-url ...` first"
                ) from None
            raise ConsumerUnavailable(f"cannot reach the database: {first_line(exc)}") from None
        rt.database_ok()

    async def _serve(self, rt: Runtime) -> None:
        assert self._force is not None
        supervised = [
            asyncio.create_task(self._supervise(rt, source), name=f"outbox-source-{source.name}")
            for source in self.sources
        ]
        keepalive = asyncio.create_task(self._housekeeping(rt), name="outbox-housekeeping")
        stopping = asyncio.create_task(rt.stopping.wait())
        await asyncio.wait([stopping, *supervised], return_when=asyncio.FIRST_COMPLETED)
        rt.stopping.set()
        pending = [task for task in supervised if not task.done()]
        if pending:
            log.info(
                "waiting up to %.0fs for the messages in hand", self.grace_period, extra={"action": "drain"}
            )
            forced: asyncio.Future[Any] = asyncio.create_task(self._force.wait())
            everything: asyncio.Future[Any] = asyncio.gather(*pending, return_exceptions=True)
            await asyncio.wait([forced, everything], timeout=self.grace_period, return_when="FIRST_COMPLETED")
            forced.cancel()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        keepalive.cancel()
        stopping.cancel()
        await asyncio.gather(keepalive, stopping, return_exceptions=True)
        for task in supervised:
            if task.done() and not task.cancelled() and task.exception() is not None:
                self._fatal = self._fatal or task.exception()
        log.info("stopped", extra={"action": "stopped", "inbox": self.inbox.name})

    async def _supervise(self, rt: Runtime, source: InboxSource) -> None:
        delay = 1.0
        while not rt.stopping.is_set():
            context = SourceRun(rt, source)
            try:
                await source.consume(context)
                if rt.stopping.is_set():
                    return
                log.warning(
                    "source %s stopped on its own; starting it again",
                    source.name,
                    extra={"action": "restart"},
                )
            except ConfigurationError as exc:
                log.error("source %s: %s", source.name, exc, extra={"action": "config_error"})
                raise
            except Exception as exc:
                log.error(
                    "source %s failed: %s; starting it again in %.0fs",
                    source.name,
                    first_line(exc),
                    delay,
                    extra={"action": "source_error", "source": source.name},
                )
            context.connected(False)
            try:
                await asyncio.wait_for(rt.stopping.wait(), timeout=delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, MAX_RESTART_DELAY)

    async def _housekeeping(self, rt: Runtime) -> None:
        """Takes up the dead letters an operator requeued, and keeps /readyz honest while no message comes.

        Every couple of seconds: ``inbox.process_requeued`` (one query when
        there is nothing to do, which is also the database check). A database
        not migrated to the requeue functions, or a login not granted them, is
        said once; the consumer goes on with a plain check instead.
        """
        requeue = True
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                if requeue:
                    results = await rt.in_thread(self.inbox.process_requeued, self.sessions)
                    for result in results:
                        self._count_requeued(result)
                else:
                    await rt.in_thread(_probe, self.sessions)
            except ConfigurationError as exc:
                requeue = False
                log.warning(
                    "requeued dead letters are not taken up: %s", exc, extra={"action": "requeue_off"}
                )
            except SQLAlchemyError as exc:
                log.warning("database check failed: %s", first_line(exc), extra={"action": "db_error"})
            else:
                rt.database_ok()

    def _count_requeued(self, result: Processed) -> None:
        """Counted; the line for each is ``process_requeued``'s own."""
        if self.metrics is not None:
            self.metrics.messages.labels(self.inbox.name, REQUEUED, result.outcome).inc()
