"""The circuit breakers this run shares with every other relay, through ``outbox_breaker``.

A handler that keeps circuit breakers, or parks messages until a destination
recovers, offers an ``outbox_share_breakers(board)`` hook (the webhook handler
and the broker publishers do); each run of the relay makes one
:class:`~outbox._breaker_board.BreakerBoard` for its engine and relay id, hands
it to every such handler before the first claim, and closes it when the run
ends, after writing what its breakers decided last. The board's first read is
awaited, so a relay that starts during an outage skips the destinations other
relays found down from its very first delivery. A hook that raises is logged
(action ``handler_breakers``) and its handler's breakers stay its own: sharing
them is never a reason not to deliver. When the board releases parked
messages (a destination is back) it wakes this run, so they are claimed at
once, on SQLite as well, where no NOTIFY would announce them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from sqlalchemy.engine import Engine

from outbox import Route
from outbox._breaker_board import BreakerBoard
from outbox._redact import Redactor

from .classify import describe
from .run_context import RunContext, log

__all__ = ["SharedBreakers"]

HOOK = "outbox_share_breakers"


class SharedBreakers:
    """The run's board, made only when some handler shares its breakers."""

    def __init__(self, rt: RunContext, engine: Engine) -> None:
        self._rt = rt
        self._engine = engine
        self.board: BreakerBoard | None = None

    async def start(self, routes: Iterable[Route], redactor: Redactor) -> None:
        sharing = [r for r in routes if callable(getattr(r.handler, HOOK, None))]
        if not sharing:
            return
        board = BreakerBoard(self._engine, self._rt.id)
        board.on_release = self._released
        for route in sharing:
            try:
                getattr(route.handler, HOOK)(board)
            except Exception as exc:
                name, text = describe(exc, redactor)
                log.warning(
                    "route %s: %s raised %s: %s; its circuit breakers stay this relay's own",
                    route.name,
                    HOOK,
                    name,
                    text,
                    extra={"action": "handler_breakers", "handler": route.name, "error_type": name},
                )
        self.board = board
        await self._rt.db(board.start)  # never raises: a failed read is logged, the thread starts

    def _released(self, destination: str, count: int) -> None:
        """On the board's thread: parked messages are due now, so claim (the NOTIFY may come later)."""
        try:
            self._rt.loop.call_soon_threadsafe(self._rt.wake.set)
        except RuntimeError:  # the run's loop has closed: nobody left to wake
            pass

    async def stop(self) -> None:
        board, self.board = self.board, None
        if board is not None:
            await asyncio.to_thread(board.close)
