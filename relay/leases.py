"""The lease keeper: renew this relay's leases, take back those other relays let lapse.

A lease is what tells every relay that a running message is being worked on.
The heartbeat renews it for every message this relay still holds (in flight,
finished but not yet written, claimed and waiting to be released), so a slow
but live delivery is never claimed twice. It never waits for a row lock
(``Store.extend``): the rows it renews are the ones the outcome writer
completes on its own connection, in another order, and waiting for each
other's rows deadlocked the two. The recoverer finds running messages
whose lease ran out (their relay crashed, hung or lost the database) and puts
them back, charged and recorded as ``lease_expired``: that is the only way a
message another process left running ever moves again. One whose payload or
headers cannot be decoded (``documents.py``), most likely what that process
crashed on, goes dead rather than due again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError

from outbox import signals

from .announce import send
from .dispatch import to_message
from .recovery import Recovered, RecoveryWindow, recover_expired
from .run_context import RunContext, first_line, log

__all__ = ["LeaseKeeper", "recover_period"]

#: Seconds between warnings about pending rows for routes this relay has no handler for.
_UNKNOWN_REPORT_EVERY = 300.0
#: Seconds between the recoverer's calls that make history partitions ahead (PostgreSQL).
PARTITIONS_EVERY = 3600.0
#: Days after today whose history partitions the relay keeps made.
PARTITION_DAYS_AHEAD = 7


def _why_dead(item: Recovered) -> str:
    if item.undecodable is not None:
        return f"; {item.undecodable}: dead"
    return "; it was its last attempt: dead" if item.dead else ""


def recover_period(lease: float) -> float:
    """Seconds between the recoverer's looks for lapsed leases (also part of the longest retry gap)."""
    return min(max(lease / 2, 0.1), 10.0)


class LeaseKeeper:
    def __init__(
        self,
        rt: RunContext,
        *,
        lease: float,
        held_ids: Callable[[], list[int]],
        on_recovered: Callable[[], None] = lambda: None,
    ) -> None:
        self._rt = rt
        self._lease = lease
        self._held_ids = held_ids
        #: recovered messages are pending again wherever they sort: the claimer claims from the front
        self._on_recovered = on_recovered
        self._window = RecoveryWindow()
        self._next_unknown_report = 0.0
        self._next_partitions = 0.0

    async def heartbeat(self) -> None:
        """Renew leases of running deliveries so a slow but live handler is never claimed twice."""
        period = max(self._lease / 3, 0.05)
        while True:
            await asyncio.sleep(period)
            await self.renew_once()

    async def renew_once(self) -> list[int]:
        """One renewal; returns the ids whose lease was lost (another relay recovered them).

        An outcome written while the renewal runs (the writer commits on its own
        connection) leaves a row this relay no longer holds: it is finished, not
        lost. Only ids still held after the renewal, yet not renewed, are lost.
        """
        ids = list(set(self._held_ids()))
        if not ids:
            return []
        try:
            kept = await self._rt.db(self._rt.store.extend, ids)
        except SQLAlchemyError as exc:
            log.warning("lease renewal failed (%s)", first_line(exc), extra={"action": "db_error"})
            return []
        if len(kept) == len(ids):
            return []
        still_held = set(self._held_ids())
        lost = sorted(i for i in ids if i not in kept and i in still_held)
        if lost:
            log.warning(
                "%d of %d leases were lost (expired and recovered by another relay?)",
                len(lost),
                len(ids),
                extra={"action": "lease_lost", "relay_id": self._rt.id},
            )
        return lost

    async def recover_once(self) -> int:
        rt = self._rt
        since = self._window.since()
        timer = time.perf_counter()
        look = await rt.db(lambda: recover_expired(rt.store, rt.backoffs, rt.rng, since=since))
        self._window.looked(since, look, time.perf_counter() - timer)
        recovered = look.recovered
        for item in recovered:
            row = item.row
            log.warning(
                "recovered message #%d from relay %s whose lease expired%s",
                row.id,
                row.locked_by,
                _why_dead(item),
                extra={
                    "action": "lease_expired",
                    "relay_id": rt.id,
                    "message_id": row.id,
                    "handler": row.handler,
                    "event_type": row.event_type,
                    "attempt": row.attempts,
                    "outcome": "lease_expired",
                    "held_by": row.locked_by,
                },
            )
            if rt.metrics is not None:
                rt.metrics.deliveries.labels(row.handler, "lease_expired").inc()
            message = to_message(row)
            if item.dead:
                send(signals.message_dead, rt.outbox, relay=rt.sender, message=message, error=item.reason)
            else:
                send(
                    signals.retry_scheduled,
                    rt.outbox,
                    relay=rt.sender,
                    message=message,
                    outcome="lease_expired",
                    delay=item.retry_in,
                    error=item.reason,
                )
        rt.result.recovered += len(recovered)
        if recovered:
            self._on_recovered()
            rt.wake.set()
        return len(recovered)

    async def recoverer(self) -> None:
        period = recover_period(self._lease)
        while True:
            try:
                await self.recover_once()
            except SQLAlchemyError as exc:
                log.warning("lease recovery failed (%s)", first_line(exc), extra={"action": "db_error"})
            if time.monotonic() >= self._next_unknown_report:
                await self.report_unknown_handlers()
            if time.monotonic() >= self._next_partitions:
                await self.history_partitions()
            await asyncio.sleep(period)

    async def history_partitions(self) -> int | None:
        """Make history partitions ahead (PostgreSQL, outbox_0024): at start-up, then every hour.

        A failure only warns: until the day's partition exists, its history goes to the
        DEFAULT partition, and the next call (or a purge) makes the partition and moves it there.
        """
        self._next_partitions = time.monotonic() + PARTITIONS_EVERY
        try:
            created = await self._rt.db(self._rt.store.history_partitions_ahead, PARTITION_DAYS_AHEAD)
        except SQLAlchemyError as exc:
            log.warning(
                "history partitions ahead not made (%s); history of days without one goes to the"
                " DEFAULT partition meanwhile",
                first_line(exc),
                extra={"action": "db_error"},
            )
            return None
        if created:
            log.info(
                "made %d history partition(s) ahead",
                created,
                extra={"action": "history_partitions", "relay_id": self._rt.id, "count": created},
            )
        return created

    async def report_unknown_handlers(self) -> None:
        """Rows for routes this relay lacks stay pending (a rolling deploy must not kill them): say so."""
        self._next_unknown_report = time.monotonic() + _UNKNOWN_REPORT_EVERY
        try:
            unknown = await self._rt.db(self._rt.store.waiting_for_unknown_handlers, self._rt.handlers)
        except SQLAlchemyError:
            return
        for name, count in sorted(unknown.items()):
            log.warning(
                "%d pending message(s) wait for route %r, which this relay has no handler for",
                count,
                name,
                extra={"action": "unknown_handler", "handler": name, "count": count},
            )
