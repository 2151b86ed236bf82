"""The Kafka source's partitions, on the event loop: each one's records in order, one at a time.

A partition's records are taken strictly in order, the next only once the
one before is committed, and each record's next offset is stored in the
transaction of its effects (``before_commit``). So the offset in the
database always means "everything before this is done": a restart or a new
owner seeks there and neither skips nor repeats a record. Partitions run in
parallel, at most ``context.concurrency`` records at once.

A record whose transaction failed is never skipped: its partition waits
(paused, so nothing more is fetched for it) and takes the same record again
after ``context.retry_delay``, until it commits, becomes a dead letter at the
inbox's ``max_failures`` (committed with its offset too), or the partition is
revoked. A revocation drops what is buffered and waits for the record in
hand; a write that comes later anyway cannot move the stored offset back.

The consumer thread reads two things from here, under a lock: which
partitions want fetching paused, and the offsets committed so far (for the
lag commits to Kafka).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.orm import Session

from outbox._inbox.cloudevents import from_cloudevent
from outbox._inbox.source import SourceContext

__all__ = ["PREFETCH_HIGH", "PREFETCH_LOW", "REVOKE_WAIT", "Key", "Partitions"]

log = logging.getLogger("outbox.integrations.kafka")

Key = tuple[str, int]
#: A partition's fetching is paused once the source holds this many of its records...
PREFETCH_HIGH = 256
#: ...and resumed when it is down to this many: librdkafka refetches what a pause dropped.
PREFETCH_LOW = 64
#: Seconds a revocation waits for a partition's record in hand before handing the partition over.
REVOKE_WAIT = 60.0


class _Partition:
    """One assigned partition: its buffered records, its worker, what it asks of the consumer thread."""

    __slots__ = (
        "committed",
        "expected",
        "gone",
        "number",
        "paused",
        "records",
        "retrying",
        "topic",
        "worker",
    )

    def __init__(self, topic: str, number: int, expected: int | None) -> None:
        self.topic = topic
        self.number = number
        #: The next offset this assignment should see (one below it means librdkafka went back).
        self.expected = expected
        self.records: deque[Any] = deque()
        self.gone = asyncio.Event()  # revoked or lost: take nothing more
        self.worker: asyncio.Task[None] | None = None
        self.retrying = False
        self.paused = False  # what the consumer thread should make of it
        #: The next offset this process committed for it (the lag commit to Kafka).
        self.committed: int | None = None


class Partitions:
    """Every partition assigned to one run of a source; runs on the loop, read by the consumer thread."""

    def __init__(self, name: str, context: SourceContext) -> None:
        self._name = name
        self._context = context
        self._owned: dict[Key, _Partition] = {}
        self._lock = threading.Lock()
        self._slots = asyncio.Semaphore(context.concurrency)
        #: Set when a partition's wish to be paused changed: the consumer thread reconciles.
        self.changed = threading.Event()

    # -- the consumer thread's rebalances, run on the loop --------------------------------------

    async def assign(self, positions: Mapping[Key, int | None]) -> None:
        """Partitions now ours, each with the offset it starts at (None: where librdkafka starts it)."""
        with self._lock:
            for (topic, number), offset in positions.items():
                old = self._owned.pop((topic, number), None)
                if old is not None:
                    self._drop(old)
                self._owned[(topic, number)] = _Partition(topic, number, offset)

    async def revoke(self, keys: Iterable[Key]) -> dict[Key, int]:
        """Stop taking the partitions' records; wait for the ones in hand; what each committed."""
        with self._lock:
            parts = [part for key in keys if (part := self._owned.pop(key, None)) is not None]
        for part in parts:
            self._drop(part)
        workers = [part.worker for part in parts if part.worker is not None]
        if workers:
            _, late = await asyncio.wait(workers, timeout=REVOKE_WAIT)
            if late:
                log.warning(
                    "source %s: %d revoked partition(s) still committing a record after %.0fs; handed "
                    "over anyway (a late commit cannot move the stored offset back)",
                    self._name,
                    len(late),
                    REVOKE_WAIT,
                    extra={"action": "kafka_revoke_late", "source": self._name},
                )
        return {(part.topic, part.number): part.committed for part in parts if part.committed is not None}

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._owned)

    @staticmethod
    def _drop(part: _Partition) -> None:
        part.gone.set()
        part.records.clear()

    # -- records ----------------------------------------------------------------------------------

    def arrived(self, records: list[Any]) -> None:
        """Records the consumer thread fetched, in order per partition: buffered, then taken."""
        touched: dict[Key, _Partition] = {}
        for record in records:
            key = (record.topic(), record.partition())
            part = self._owned.get(key)
            if part is None:  # fetched for an assignment that has ended since
                continue
            offset = record.offset()
            if part.expected is not None and offset < part.expected:
                # librdkafka went back: the stored offset was out of range (the topic was
                # recreated, or truncated) and auto.offset.reset applied. Skipping would lose
                # these records; taking them is safe, the inbox knows a duplicate by its id.
                log.warning(
                    "source %s: %s[%d] went back from offset %d to %d (was the topic recreated?); "
                    "taking its records again, duplicates are recognised by their ids",
                    self._name,
                    part.topic,
                    part.number,
                    part.expected,
                    offset,
                    extra={"action": "kafka_offset_reset", "source": self._name},
                )
            part.expected = offset + 1
            part.records.append(record)
            touched[key] = part
        for part in touched.values():
            self._want_paused(part)
            if part.worker is None and not self._context.stopping.is_set():
                part.worker = asyncio.create_task(
                    self._work(part), name=f"outbox-kafka-{part.topic}-{part.number}"
                )

    def _want_paused(self, part: _Partition) -> None:
        held = len(part.records)
        wanted = part.retrying or held >= PREFETCH_HIGH or (part.paused and held > PREFETCH_LOW)
        if wanted != part.paused:
            part.paused = wanted
            self.changed.set()

    async def _work(self, part: _Partition) -> None:
        try:
            while part.records and not part.gone.is_set() and not self._context.stopping.is_set():
                if not await self._take(part, part.records[0]) or part.gone.is_set():
                    return  # revoked meanwhile: its records were dropped, the next owner has them
                part.records.popleft()
                part.retrying = False
                self._want_paused(part)
        finally:
            part.worker = None

    async def _take(self, part: _Partition, record: Any) -> bool:
        """Take one record until it is committed; False if the partition or the source stops first.

        Kafka counts no deliveries, so each message goes to the inbox as attempt 1
        and the runtime counts its handler's failures (a database outage is no
        failure of the message's). ``tries`` only spaces the retries.
        """
        context = self._context
        tries = 1
        while True:
            async with self._slots:
                if part.gone.is_set() or context.stopping.is_set():
                    return False
                try:
                    if await self._once(part, record):
                        return True
                except Exception:  # a bug, not the record's fault: never skip it, take it again later
                    log.exception(
                        "source %s: taking %s[%d] offset %d failed",
                        self._name,
                        part.topic,
                        part.number,
                        record.offset(),
                        extra={"action": "kafka_take_failed", "source": self._name},
                    )
            part.retrying = True
            self._want_paused(part)
            delay = context.retry_delay(tries)
            tries += 1
            if await self._interrupted(part, delay):
                return False

    async def _once(self, part: _Partition, record: Any) -> bool:
        context = self._context
        topic, number, offset = part.topic, part.number, record.offset()
        next_offset = offset + 1
        message, problem = from_cloudevent(
            record.headers(),
            record.value() or b"",
            source=self._name,
            fallback_id=f"{topic}/{number}/{offset}",  # a record's place in the log is its identity
        )
        inbox = context.inbox

        def store(session: Session) -> None:
            inbox.store_offset(session, topic, number, next_offset)

        def committed() -> None:
            part.committed = max(part.committed or 0, next_offset)

        if problem is not None:
            return await context.refuse(message, problem, ack=committed, before_commit=store)
        return await context.take(message, ack=committed, before_commit=store) is not None

    async def _interrupted(self, part: _Partition, delay: float) -> bool:
        """Wait ``delay`` seconds; True if the partition was revoked or the source stopped meanwhile."""
        waits = [
            asyncio.ensure_future(part.gone.wait()),
            asyncio.ensure_future(self._context.stopping.wait()),
        ]
        try:
            done, _ = await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return bool(done)

    # -- read by the consumer thread --------------------------------------------------------------

    def pauses(self) -> dict[Key, bool]:
        """Whether each partition wants its fetching paused."""
        with self._lock:
            return {key: part.paused for key, part in self._owned.items()}

    def committed(self) -> dict[Key, int]:
        """The next offset committed so far for each partition this process committed a record of."""
        with self._lock:
            return {key: part.committed for key, part in self._owned.items() if part.committed is not None}

    # -- ending -----------------------------------------------------------------------------------

    async def finish(self) -> None:
        """Wait for the records in hand (the source is stopping: no new one is taken)."""
        with self._lock:
            workers = [part.worker for part in self._owned.values() if part.worker is not None]
        if workers:
            await asyncio.wait(workers)

    def abandon(self) -> None:
        """Cancel every partition's work at once (the runtime gave up waiting)."""
        with self._lock:
            parts = list(self._owned.values())
            self._owned.clear()
        for part in parts:
            self._drop(part)
            if part.worker is not None:
                part.worker.cancel()
