"""Live pages: one change feed per app, fanned out to every open page (``_events`` streams it).

However many pages are open, the database sees one watcher: it re-reads
:func:`outbox.ops.change_marker` every ``poll_interval`` (SQLite), or when
PostgreSQL's NOTIFY says a message was committed and at least every few
seconds for the rest (deliveries do not notify). The watcher stops when the
last page closes, so an idle dashboard holds no connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sqlalchemy.engine import Engine
from starlette.concurrency import run_in_threadpool

from .. import ops
from .._first_line import first_line

__all__ = ["ChangeFeed"]

log = logging.getLogger("outbox.dashboard")

#: With LISTEN, how often the watcher still looks for changes NOTIFY does not announce.
LISTEN_POLL = 3.0


class ChangeFeed:
    def __init__(
        self, engine: Engine, poll_interval: float, *, on_change: Callable[[], None] | None = None
    ) -> None:
        self._engine = engine
        self._on_change = on_change
        self._poll = poll_interval
        self._version = 0
        self._changed = asyncio.Condition()
        self._watchers = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def version(self) -> int:
        return self._version

    @property
    def watching(self) -> bool:
        """True while some page is subscribed and the watcher reads the database."""
        return self._task is not None and not self._task.done()

    async def subscribe(self) -> AsyncIterator[int]:
        """Yields the new version after each change, until the caller stops iterating."""
        self._watchers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="outbox-dashboard-feed")
        try:
            seen = self._version
            while True:
                async with self._changed:
                    await self._changed.wait_for(functools.partial(self._moved_on, seen))
                seen = self._version
                yield seen
        finally:
            self._watchers -= 1
            if self._watchers == 0 and self._task is not None:
                self._task.cancel()
                self._task = None

    def _moved_on(self, seen: int) -> bool:
        return self._version != seen

    async def _watch(self) -> None:
        listener = await self._listener()
        try:
            interval = LISTEN_POLL if listener is not None else self._poll
            marker = await self._marker()
            while True:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), interval)
                current = await self._marker()
                if current is not None and current != marker:
                    marker = current
                    await self._refresh_figures()
                    async with self._changed:
                        self._version += 1
                        self._changed.notify_all()
        finally:
            if listener is not None:
                listener.cancel()
                with contextlib.suppress(BaseException):
                    await listener

    async def _refresh_figures(self) -> None:
        """Before the pages hear of a change, so the reload they make finds the new figures."""
        if self._on_change is None:
            return
        try:
            await run_in_threadpool(self._on_change)
        except Exception as exc:  # the pages still reload; they read for themselves
            log.warning("dashboard change feed: %s", first_line(exc))

    async def _marker(self) -> tuple[Any, ...] | None:
        try:
            return await run_in_threadpool(ops.change_marker, self._engine)
        except Exception as exc:  # a database outage: keep the pages open, look again later
            log.warning("dashboard change feed: %s", first_line(exc))
            return None

    async def _listener(self) -> asyncio.Task[None] | None:
        if self._engine.dialect.name != "postgresql":
            return None
        from outbox.relay.db import Listener  # type: ignore[import-not-found,unused-ignore]

        listener = Listener(self._engine, on_notify=lambda _: self._wake.set(), on_listening=self._wake.set)
        return asyncio.create_task(listener.run(), name="outbox-dashboard-listen")
