"""The scans a listening relay runs beside its claims, so that no claim waits for them.

Both start at the front of the claim index (``ix_outbox_message_claim``),
where every claimed row leaves a dead entry that stays while a transaction
holds back vacuum; run inside a claim round, each would hold up every claim,
and with it every commit's wake-up, for as long as it walks them:

- the look behind a queue's claim position for rows the claims stepped over
  (``claim_position.py``), which moves the position back to the first found;
- the discovery of queues named only at emit time, which a listening relay
  mostly learns from the NOTIFYs anyway (``Store.pending_queues``).

Each runs on a database thread, on a connection of the engine's pool, at most
one at a time per queue (one discovery at a time), and is spaced a hundred
times its own cost apart, so while it is costly it takes about 1 % of the time.
A relay that does not listen runs neither here: it claims from the front, and
discovers queues, inside its claim rounds, as it always did.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

from sqlalchemy.exc import SQLAlchemyError

from .claim_position import ClaimPositions
from .run_context import RunContext, first_line, log

__all__ = ["BesideTheClaims"]

#: How many times its own duration apart discoveries run, at least...
_DISCOVERY_SPACING: Final = 100.0
#: ...but never longer apart than this (or the poll interval, if that is longer).
_DISCOVERY_MAX: Final = 10.0


class BesideTheClaims:
    def __init__(self, rt: RunContext, positions: ClaimPositions, known_queues: set[str]) -> None:
        self._rt = rt
        self._positions = positions
        self._known_queues = known_queues  # the claimer's own set: what is found here is claimed next
        self._looking: dict[str, asyncio.Task[None]] = {}
        self._discovering: asyncio.Task[None] | None = None
        self._discover_after = 0.0

    def look_behind(self, queue: str) -> None:
        """Start a look for rows the claims of ``queue`` stepped over, if one is due and none runs."""
        before = self._positions.sweep_due(queue)
        if before is None or queue in self._looking:
            return
        self._looking[queue] = asyncio.create_task(self._look(queue, before), name=f"outbox-look-{queue}")

    def discover(self) -> None:
        """Start looking for queues with pending messages, unless a look runs or ran too recently."""
        if self._discovering is None and time.monotonic() >= self._discover_after:
            self._discovering = asyncio.create_task(self._discover(), name="outbox-discover-queues")

    def cancel(self) -> None:
        for task in [*self._looking.values(), *([self._discovering] if self._discovering else [])]:
            task.cancel()

    async def _look(self, queue: str, before: tuple[int, int]) -> None:
        rt = self._rt
        timer = time.perf_counter()
        try:
            found = await rt.db(rt.store.first_due_before, queue, rt.handlers, before)
        except Exception as exc:  # the next claim round tries again; the claims never depended on it
            _failed(f"looking behind the claim position of {queue}", exc)
            found = None
        finally:
            self._positions.swept(queue, time.perf_counter() - timer)
            del self._looking[queue]
        if found is not None:
            self._positions.lower(queue, found)
            rt.wake.set()

    async def _discover(self) -> None:
        rt = self._rt
        timer = time.perf_counter()
        try:
            found = set(await rt.db(rt.store.pending_queues))
        except Exception as exc:  # the next poll tries again
            _failed("finding the queues with pending messages", exc)
            found = set()
        finally:
            self._discovering = None
            spaced = min((time.perf_counter() - timer) * _DISCOVERY_SPACING, _DISCOVERY_MAX)
            self._discover_after = time.monotonic() + spaced
        if found - self._known_queues:
            self._known_queues.update(found)
            rt.wake.set()


def _failed(what: str, exc: Exception) -> None:
    log.warning(
        "%s failed (%s)",
        what,
        first_line(exc),
        exc_info=not isinstance(exc, SQLAlchemyError),
        extra={"action": "db_error"},
    )
