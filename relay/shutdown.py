"""Stopping: hand back what never started, let in-flight work finish, write the last outcomes.

Two endings share these steps. A serving relay that was asked to stop
(:meth:`Shutdown.graceful`): release unstarted claims at once, give in-flight
deliveries the grace period, cancel what is left (recorded as attempts that
may have taken effect), then write what remains, retrying for a while. The
end of a drain, interrupted or not (:meth:`Shutdown.end_of_drain`): one try
only, because an interrupted caller wants out.

Whatever cannot be written or released here keeps its lease until it expires;
another relay then takes it back, charged and recorded as ``lease_expired``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from .claimer import Claimer
from .run_context import RunContext, first_line, log
from .writer import OutcomeWriter

__all__ = ["Shutdown"]


class Shutdown:
    def __init__(
        self, rt: RunContext, claimer: Claimer, writer: OutcomeWriter, *, grace_period: float
    ) -> None:
        self._rt = rt
        self._claimer = claimer
        self._writer = writer
        self._grace_period = grace_period

    async def graceful(self, background: list[asyncio.Task[Any]]) -> None:
        for task in background:
            if task.get_name() in ("outbox-listen", "outbox-recoverer"):
                task.cancel()
        # Deliveries claimed in the same round as the stop find it when they first run; hand
        # them back now, not after the grace period, so another relay can take them at once.
        await asyncio.sleep(0)
        await self._release_unstarted(raise_errors=False)
        inflight = self._claimer.tasks()  # a batch's messages share one task
        if inflight:
            log.info(
                "waiting up to %.0fs for %d in-flight deliveries",
                self._grace_period,
                len(self._claimer.inflight),
                extra={"action": "drain", "relay_id": self._rt.id},
            )
            forced: asyncio.Task[Any] = asyncio.create_task(self._rt.force.wait())
            everything: asyncio.Future[Any] = asyncio.gather(*inflight, return_exceptions=True)
            await asyncio.wait(
                [forced, everything], timeout=self._grace_period, return_when=asyncio.FIRST_COMPLETED
            )
            forced.cancel()
            late = [t for t in inflight if not t.done()]
            cut = len(self._claimer.inflight)
            for task in late:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            if late:
                log.warning(
                    "cancelled %d deliveries still running at shutdown; they will be retried",
                    cut,
                    extra={"action": "cancel", "relay_id": self._rt.id},
                )
        await self._final_writes()

    async def _release_unstarted(self, *, raise_errors: bool = True) -> None:
        """Hand back claimed messages whose delivery never began: no attempt, no history."""
        claims = self._claimer.unstarted()
        if not claims:
            return
        try:
            released = await self._rt.db(self._rt.store.release, claims)
        except SQLAlchemyError:
            if raise_errors:
                raise
            return  # kept as unstarted (their leases renewed) for the final writes to retry
        log.info("released %d unstarted message(s)", released, extra={"action": "release"})
        self._claimer.released(claims)

    async def _final_writes(self) -> None:
        deadline = time.monotonic() + max(5.0, min(self._grace_period, 30.0))
        while True:
            try:
                await self._release_unstarted()
                await self._writer.write_pending()
                return
            except SQLAlchemyError as exc:
                if time.monotonic() > deadline:
                    log.error(
                        "giving up recording %d outcome(s) at shutdown (%s); their leases will expire "
                        "and they will be delivered again",
                        len(self._writer) + len(self._claimer.unstarted()),
                        first_line(exc),
                        extra={"action": "db_error", "relay_id": self._rt.id},
                    )
                    return
                await asyncio.sleep(0.5)

    async def end_of_drain(self) -> None:
        """After a drain (interrupted or not): record cancelled attempts, hand back what never started.

        Every delivery that began has an outcome by now (cancelled ones too).
        What this drain claimed and never started (the interrupt came before its
        task ran) goes back untouched. Nothing else does: a row still running
        under this relay's id may be an attempt an earlier process made before
        it crashed, and refunding it would erase that attempt; it leaves through
        lease expiry, charged and recorded. One try only: if the database is
        what failed, the leases expire and the messages are recovered as usual.
        """
        try:
            await self._writer.write_pending()
            await self._release_unstarted()
        except Exception as exc:
            left = len(self._writer) + len(self._claimer.unstarted())
            if not left:  # a drain that failed before claiming anything: nothing was lost, say nothing
                return
            log.warning(
                "could not record %d outcome(s) of the interrupted drain (%s); their leases will expire",
                left,
                first_line(exc),
                extra={"action": "db_error", "relay_id": self._rt.id},
            )
