"""A broker publisher's outages: park what cannot be sent, probe the broker, release all when it is back.

While a broker is away, a message claimed for it is *parked* on it
(``RetryLater(until_recovered=destination)``): deferred without using an
attempt, for at most ``PARKED_DELAY`` seconds, and without a connection
attempt of its own. One probe per relay (per event loop) tries the broker
every ``PROBE_INTERVAL`` seconds; its first success reports the broker back to
the relay's breaker board (:meth:`~outbox._breaker_board.BreakerBoard.recovered`),
which makes every message parked on it due now, in every relay. The board
comes through the relay's ``outbox_share_breakers`` hook; without one (a
publisher called outside a relay) nothing could release a parked message, so
nothing parks and the publisher defers as it did before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from outbox import RetryLater

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

__all__ = ["PARKED_DELAY", "PROBE_INTERVAL", "Probe", "Recovery"]

#: While a broker is away, one try to reach it per relay this often.
PROBE_INTERVAL = 1.0
#: The longest a parked message waits should the broker's return never be reported.
PARKED_DELAY = 60.0

log = logging.getLogger("outbox.integrations.brokers")


class Recovery:
    """One publisher's side of parking: its destination key, and the board that releases what is parked."""

    def __init__(self, destination: str, shown_as: str) -> None:
        #: what messages are parked on: the broker's address, never a credential
        self.destination = destination
        self.shown_as = shown_as  # the broker as logs name it (password masked)
        self._board: BreakerBoard | None = None

    def share(self, board: BreakerBoard) -> None:
        self._board = board

    @property
    def parks(self) -> bool:
        """Whether a deferral may park: only a relay's open board can carry the news of the return."""
        return self._board is not None and not self._board.closed

    def parked(self, why: str, detail: dict[str, Any]) -> RetryLater:
        return RetryLater(
            f"{self.shown_as}: {why}; parked until it is back, not counted",
            until_recovered=self.destination,
            delay=PARKED_DELAY,
            detail=detail,
        )

    def away(self, why: str) -> None:
        log.warning(
            "%s is unreachable (%s); parking its messages and trying it every %gs",
            self.shown_as,
            why,
            PROBE_INTERVAL,
            extra={"action": "broker_away", "destination": self.destination},
        )

    def back(self) -> None:
        """The broker answers again: release every message parked on it (any thread)."""
        log.info(
            "%s is back; the messages parked on it are due now",
            self.shown_as,
            extra={"action": "broker_back", "destination": self.destination},
        )
        if self._board is not None:
            self._board.recovered(self.destination)


class Probe:
    """The one reconnect probe of an event loop's connection, running while the broker is away."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    @property
    def away(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, recovery: Recovery, why: str, reach: Callable[[], Awaitable[object]]) -> None:
        """Unless one runs already, try ``reach()`` every ``PROBE_INTERVAL``; report the first success."""
        if self.away:
            return
        recovery.away(why)
        self._task = asyncio.get_running_loop().create_task(
            self._run(recovery, reach), name=f"outbox-probe {recovery.destination}"
        )

    async def _run(self, recovery: Recovery, reach: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL)
            try:
                await reach()
            except Exception as exc:  # still away: refused, reset, timed out
                log.debug("%s: still away (%s)", recovery.shown_as, type(exc).__name__)
                continue
            break
        recovery.back()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
