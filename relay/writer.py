"""The outcome writer: finished attempts, written back in batches, then announced.

Deliveries hand their outcome to :meth:`OutcomeWriter.add`; one task writes
whatever has gathered as one statement (PostgreSQL with psycopg: one round
trip on a connection of the writer's own) or one transaction, so a burst of
deliveries costs one write, not one per message. A failed batch is kept, in
order, and written again: an outage delays the record, it never loses it.
Only once a batch is written are its outcomes announced (log line, metrics,
signals), so nothing is announced that the database does not hold.

Until its outcome is written, a message's lease must stay renewed: the writer
reports every id it still holds, buffered or being written, through
:meth:`OutcomeWriter.held_ids`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.exc import DataError, IntegrityError, ProgrammingError, SQLAlchemyError

from outbox import Message, signals

from .announce import send
from .db import HOT_PATH, LoopConnection
from .outcomes import Completion
from .run_context import RunContext, backoff_delay, first_line, log

__all__ = ["OutcomeWriter"]

Outcome = tuple[Message, Completion]

#: Seconds a small batch of outcomes may wait for more (see OutcomeWriter._gather). Far below
#: any lease, and below the time a claim and a delivery take anyway.
LINGER = 0.005


class OutcomeWriter:
    def __init__(self, rt: RunContext) -> None:
        self._rt = rt
        self._buffer: list[Outcome] = []
        self._writing: list[Outcome] = []  # taken off the buffer, not yet known to be written
        self._buffered = asyncio.Event()
        self._lock = asyncio.Lock()
        self._recorder = (
            LoopConnection(rt.store.engine, "outbox-relay write", settings=HOT_PATH)
            if rt.store.fast
            else None
        )
        #: called with each written batch: written outcomes free their delivery slots, and a retry or a
        #: finished group member tells the claimer where in its queue something becomes claimable
        self.on_written: Callable[[list[Outcome]], None] = lambda batch: None
        #: deliveries still running (the claimer's count): more outcomes are on their way
        self.deliveries_running: Callable[[], int] = lambda: 0
        #: a batch this small waits up to LINGER for company while deliveries still run
        self.min_batch = 1
        #: the wake-up set for the soonest retry due before the next poll (see _wake_for_retries)
        self._retry_wake: asyncio.TimerHandle | None = None

    # -- what the others see ------------------------------------------------------

    def add(self, message: Message, completion: Completion) -> None:
        self._buffer.append((message, completion))
        self._buffered.set()

    def __len__(self) -> int:
        """Outcomes not yet written: they still hold their delivery slot."""
        return len(self._buffer)

    def held_ids(self) -> list[int]:
        """Messages whose outcome is not yet written: their leases must outlive the write."""
        return [c.message_id for _, c in (*self._buffer, *self._writing)]

    # -- the task -----------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing buffered and nothing being written: every outcome so far is in the database."""
        return not self._buffer and not self._writing

    async def run(self, *, retry: bool = True) -> None:
        """Write batches as outcomes arrive, for as long as the relay runs.

        Serving, a failed write is retried with backoff (an outage delays the
        record). Draining (``retry=False``), the error ends this task, and the
        drain that awaits it raises it: a caller asking to "deliver everything
        now" wants to know.
        """
        failures = 0
        while True:
            await self._buffered.wait()
            await self._gather()
            try:
                await self.write_pending()
                failures = 0
            except Exception as exc:
                if not retry:
                    raise
                # Not only database errors: if this task died, outcomes would silently stop being
                # recorded while leases lapse and every message is delivered again and again.
                failures += 1
                delay = backoff_delay(failures)
                log.warning(
                    "could not record %d outcome(s) (%s); retrying in %.1fs",
                    len(self._buffer),
                    first_line(exc),
                    delay,
                    exc_info=not isinstance(exc, SQLAlchemyError),
                    extra={"action": "db_error", "relay_id": self._rt.id, "failures": failures},
                )
                await asyncio.sleep(delay)

    async def _gather(self) -> None:
        """Let a small batch wait a moment for the outcomes still on their way.

        Handlers that finish one by one (a broker confirm, an HTTP response)
        would otherwise cost one write per outcome or two, each a statement for
        the database to run. The wait is bounded (``LINGER``) and skipped when
        nothing else is running, so a lone outcome is written at once.
        """
        if len(self._buffer) >= self.min_batch or not self.deliveries_running():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER
        while len(self._buffer) < self.min_batch and self.deliveries_running():
            self._buffered.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._buffered.wait()
            except TimeoutError:
                break
        self._buffered.set()  # write_pending runs next, whatever woke this wait

    async def write_pending(self) -> None:
        async with self._lock:
            self._buffered.clear()
            batch, self._buffer = self._buffer, []
            if not batch:
                return
            # A write can stall (a lock, a slow server) past the lease: its messages stay held.
            self._writing = batch
            try:
                try:
                    await self._record([c for _, c in batch])
                except (DataError, IntegrityError, ProgrammingError) as exc:
                    # Not an outage: the database refuses something in this batch. Retrying it
                    # whole would stall every later outcome behind it, so find the culprit.
                    await self._record_one_by_one(batch, exc)
            except BaseException:
                self._buffer[:0] = batch  # keep them, in order, for the next try
                self._buffered.set()
                raise
            finally:
                self._writing = []
        self.on_written(batch)
        self._wake_for_retries(batch)
        for message, completion in batch:
            self._announce(message, completion)

    def _wake_for_retries(self, batch: list[Outcome]) -> None:
        """Claim again when a retry due before the next poll comes due, not at the poll.

        A retry of a second or less (a circuit breaker's next trial, a broker
        reconnecting) would otherwise wait for the poll as well, which no NOTIFY
        cuts short. The timer starts after the write, so it never fires before
        the database's own clock makes the message due.
        """
        soonest = min((c.retry_in for _, c in batch if c.status == "pending"), default=None)
        if soonest is None or soonest >= self._rt.poll_interval:
            return
        loop = self._rt.loop
        when = loop.time() + soonest + 0.005  # a hair after: a claim at the very instant may miss it
        if self._retry_wake is not None and not self._retry_wake.cancelled():
            if self._retry_wake.when() <= when and self._retry_wake.when() >= loop.time():
                return  # an earlier wake-up is set already
            self._retry_wake.cancel()
        self._retry_wake = loop.call_at(when, self._rt.wake.set)

    async def close(self) -> None:
        if self._retry_wake is not None:
            self._retry_wake.cancel()
        if self._recorder is not None:
            await self._recorder.close()

    # -- writing ------------------------------------------------------------------

    async def _record(self, outcomes: list[Completion]) -> None:
        if self._recorder is not None:
            await self._rt.store.complete_on(self._recorder, outcomes)
        else:
            await self._rt.db(self._rt.store.complete, outcomes)

    async def _record_one_by_one(self, batch: list[Outcome], refused: Exception) -> None:
        """Record each outcome alone; one the database still refuses is recorded without its text.

        Nothing is dropped: the attempt, its outcome and the message's next
        status are kept, and the history says why its error and detail are missing.
        """
        written = 0
        try:
            for index, (message, completion) in enumerate(batch):
                await self._record_alone(batch, index, message, completion)
                written += 1
        except BaseException:
            # An outage halfway: what is written must not be buffered again (its history would
            # be appended twice); the caller keeps the rest, and its list is this one.
            announced = batch[:written]
            del batch[:written]
            for message, completion in announced:
                self._announce(message, completion)
            raise
        log.warning(
            "a batch of %d outcomes was refused (%s) and recorded one by one",
            len(batch),
            first_line(refused),
            extra={"action": "db_error", "relay_id": self._rt.id},
        )

    async def _record_alone(
        self, batch: list[Outcome], index: int, message: Message, completion: Completion
    ) -> None:
        """Record one outcome; if the database refuses it, record it without its text instead.

        An ``expired`` outcome the database refuses (it judges expiry by its own
        clock, which was stepped back, or someone moved ``expires_at`` by hand)
        is handed back instead: due again at once, its attempt not counted, so
        the next claim judges it afresh.
        """
        try:
            await self._record([completion])
            return
        except (DataError, IntegrityError, ProgrammingError) as exc:
            reason = first_line(exc)
        if completion.outcome == "expired":
            log.warning(
                "the database does not see %s #%d as expired (%s); handing it back",
                message.event_type,
                message.id,
                reason,
                extra={"action": "db_error", "message_id": message.id, "handler": message.handler},
            )
            back = dataclasses.replace(
                completion,
                outcome="retry",
                status="pending",
                retry_in=0.0,
                refund=True,
                error_type="NotExpired",
                error="the database did not see this message as expired yet; handed back",
                detail={"counted": False, "refused": reason[:500]},
            )
            batch[index] = (message, back)
            await self._record([back])
            return
        log.error(
            "outcome of %s #%d was refused by the database (%s); recording it without its text",
            message.event_type,
            message.id,
            reason,
            extra={"action": "db_error", "message_id": message.id, "handler": message.handler},
        )
        plain = dataclasses.replace(
            completion,
            error_type=None if completion.error_type is None else "UnstorableError",
            error=None if completion.error is None else "the error text could not be stored",
            detail={"unstorable_outcome": reason[:500]},
        )
        batch[index] = (message, plain)
        await self._record([plain])

    # -- announcing ---------------------------------------------------------------

    def _announce(self, message: Message, completion: Completion) -> None:
        rt = self._rt
        if rt.metrics is not None:
            rt.metrics.observe(message, completion)
        duration = (completion.finished_at - completion.started_at).total_seconds()
        if completion.status == "delivered":
            rt.result.delivered += 1
            if log.isEnabledFor(logging.INFO):  # a relay at WARNING builds no fields for each delivery
                log.info(
                    "delivered %s #%d to %s (attempt %d, %.0f ms)",
                    message.event_type,
                    message.id,
                    message.handler,
                    message.attempt,
                    duration * 1000,
                    extra={"action": "deliver", **self._fields(message, completion)},
                )
            send(signals.message_delivered, rt.outbox, relay=rt.sender, message=message, duration=duration)
            return
        extra = self._fields(message, completion)
        if completion.status == "pending":
            rt.result.retried += 1
            log.warning(
                "%s #%d to %s failed (%s: %s); retry in %.1fs",
                message.event_type,
                message.id,
                message.handler,
                completion.outcome,
                completion.error,
                completion.retry_in,
                extra={"action": "retry", **extra},
            )
            send(
                signals.retry_scheduled,
                rt.outbox,
                relay=rt.sender,
                message=message,
                outcome=completion.outcome,
                delay=completion.retry_in,
                error=completion.error,
            )
            if completion.retry_in < rt.poll_interval:
                rt.loop.call_later(completion.retry_in, rt.wake.set)
        elif completion.status == "discarded":  # expired: the only discard a relay makes
            rt.result.expired += 1
            log.warning(
                "%s #%d to %s expired at %s before attempt %d; discarded, not delivered",
                message.event_type,
                message.id,
                message.handler,
                _when(message.expires_at),
                message.attempt,
                extra={"action": "expired", **extra},
            )
            send(signals.message_expired, rt.outbox, relay=rt.sender, message=message)
        else:
            rt.result.dead += 1
            log.error(
                "%s #%d to %s is dead after attempt %d: %s",
                message.event_type,
                message.id,
                message.handler,
                message.attempt,
                completion.error,
                extra={"action": "dead", **extra},
            )
            send(signals.message_dead, rt.outbox, relay=rt.sender, message=message, error=completion.error)

    def _fields(self, message: Message, completion: Completion) -> dict[str, Any]:
        """The structured fields of an outcome's log line."""
        return {
            "relay_id": self._rt.id,
            "message_id": message.id,
            "handler": message.handler,
            "event_type": message.event_type,
            "attempt": message.attempt,
            "outcome": completion.outcome,
        }


def _when(moment: datetime | None) -> str:
    return "an unknown time" if moment is None else moment.astimezone(UTC).isoformat()
