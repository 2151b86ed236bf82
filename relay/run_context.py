"""What every part of one running relay shares: its settings, its wake-ups, its database threads.

A :class:`RunContext` is made each time a relay starts serving or draining, and
dropped when it stops. It holds no delivery state of its own: the claimer, the
outcome writer and the lease keeper each own theirs, and reach each other only
through the methods they offer. What is here is what they all need: the store,
the thread pool that runs its synchronous statements, the events that wake the
serve loop or stop it, and the running totals a drain returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from outbox import Backoff
from outbox._first_line import first_line

from .dispatch import is_async_handler
from .settings import RelaySettings
from .tracing import RelayTracing

__all__ = ["DrainResult", "RunContext", "backoff_delay", "first_line", "log", "supervise"]

log = logging.getLogger("outbox.relay")

T = TypeVar("T")


@dataclass(slots=True)
class DrainResult:
    """What one :meth:`Relay.run_until_idle` did."""

    delivered: int = 0
    retried: int = 0
    dead: int = 0
    recovered: int = 0
    #: claimed past their expires_at: discarded, never handed to a handler
    expired: int = 0

    @property
    def attempts(self) -> int:
        """Outcomes recorded: every claim counts an attempt, an expired one included."""
        return self.delivered + self.retried + self.dead + self.expired


def backoff_delay(failures: int) -> float:
    """Seconds to wait after ``failures`` consecutive failures: 0.25 s doubling, at most 30 s."""
    return float(min(30.0, 0.25 * 2 ** min(failures - 1, 10)))


#: A background task that ran at least this long before failing starts its back-off afresh.
_HEALTHY_RUN = 60.0


async def supervise(name: str, run: Callable[[], Awaitable[None]], *, relay_id: str) -> None:
    """Run a background loop of the relay for as long as the relay runs, whatever it raises.

    The relay's background loops (writer, heartbeat, recoverer, LISTEN,
    metrics) never return and handle the errors they expect themselves. Any
    other error, or a return, would silently end the loop while the relay kept
    serving without it: here it is logged with its traceback (action
    ``task_restart``) and the loop starts again after a back-off.
    """
    failures = 0
    while True:
        began = time.monotonic()
        # The exception itself, not exc_info=True: the log call comes after the except block,
        # where sys.exc_info() is empty again and the traceback would read "NoneType: None".
        error: Exception | None = None
        try:
            await run()
            problem = "ended"
        except Exception as exc:
            error = exc
            problem = f"failed ({type(exc).__name__})"
        if time.monotonic() - began > _HEALTHY_RUN:
            failures = 0
        failures += 1
        delay = backoff_delay(failures)
        log.error(
            "relay task %s %s; restarting it in %.1fs",
            name,
            problem,
            delay,
            exc_info=error,
            extra={"action": "task_restart", "task": name, "relay_id": relay_id, "failures": failures},
        )
        await asyncio.sleep(delay)


class RunContext:
    """The shared context of one serve or drain; made on the event loop that runs it."""

    def __init__(self, settings: RelaySettings, *, sender: object) -> None:
        # The Relay, only ever passed on as signals' relay=: typed object, so no part of a run reads it.
        self.sender = sender
        self.id = settings.id
        self.outbox = outbox = settings.outbox
        self.store = settings.store
        self.routes = routes = settings.routes
        self.handlers = sorted(routes)
        self.backoffs: dict[str, Backoff] = {r.name: r.backoff for r in routes.values()}
        #: Routes whose handler is awaited on the loop (the others run in threads); asked once per
        #: run, not per delivery, where inspecting the handler was 3 % of a no-op delivery's CPU.
        self.async_routes = frozenset(r.name for r in routes.values() if is_async_handler(r.handler))
        self.redactor = settings.redactor
        self.rng = settings.rng
        self.metrics = settings.metrics
        self.poll_interval = settings.poll_interval
        self.tracing = RelayTracing(outbox, routes)
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.force = asyncio.Event()
        self.stop_requested = asyncio.Event()
        self.stopping = False
        self.result = DrainResult()
        self._db_pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="outbox-db")

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a short synchronous store call on the database threads."""
        return await self.loop.run_in_executor(self._db_pool, lambda: fn(*args))

    def request_stop(self, graceful: bool) -> None:
        if self.stopping or not graceful:
            self.force.set()
        if not self.stopping:
            log.info("stopping: no new claims", extra={"action": "stop", "relay_id": self.id})
        self.stopping = True
        self.stop_requested.set()
        self.wake.set()

    async def sleep(self, seconds: float, *, wakeable: bool = True) -> None:
        """Wait for a wake-up (or, when backing off from an outage, only for a stop request)."""
        waiter = self.wake if wakeable else self.stop_requested
        try:
            # asyncio.timeout, not wait_for: no extra Task on the commit-to-claim path.
            async with asyncio.timeout(seconds):
                await waiter.wait()
        except TimeoutError:
            pass

    def close(self) -> None:
        self._db_pool.shutdown(wait=True)
