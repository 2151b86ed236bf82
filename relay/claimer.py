"""The claimer: claim rounds, and one delivery task per claimed message (or per batch).

It owns every message between its claim and the hand-over of its outcome to
the writer: which are in flight (and in which queue, for per-queue caps),
which were claimed but never started. A delivery slot stays taken until the
outcome is written (the writer's count is part of :meth:`Claimer.free`), so a
database that falls behind makes the relay claim less instead of piling up
results in memory.

A claimed row whose payload or headers could not be decoded
(``documents.py``) is never given to its handler: its delivery task hands the
writer a dead outcome with the reason at once. Nor is one claimed past its
``expires_at``: its outcome is ``expired``, and the message is discarded.

The rows a claim took for a route whose handler takes batches
(``outbox_deliver_batch``) share one delivery task, which hands them to the
handler in one call (``batch.py``); everything the claimer counts is still
counted per message: in-flight claims, per-queue slots, unstarted claims.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from outbox import signals

from .announce import send
from .batch import batch_routes, deliver_batch
from .beside_claims import BesideTheClaims
from .claim_position import END, ClaimPositions, Position, named_position, of_schema
from .db import HOT_PATH, LoopConnection
from .deadline import Deadline
from .dispatch import (
    CANCELLED,
    attempt,
    cut_off,
    expired,
    expired_outcome,
    to_message,
    undecodable_outcome,
)
from .documents import undecodable
from .run_context import RunContext, log
from .threads import DaemonPool
from .writer import Outcome, OutcomeWriter

__all__ = ["Claimer"]


class Claimer:
    def __init__(
        self,
        rt: RunContext,
        writer: OutcomeWriter,
        *,
        queues: Sequence[str] | None,
        concurrency: int,
        queue_concurrency: Mapping[str, int],
        batch_size: int,
        listening: Callable[[], bool] = lambda: False,
    ) -> None:
        self._rt = rt
        self._writer = writer
        self._queues = queues
        self._concurrency = concurrency
        self._queue_concurrency = queue_concurrency
        self._batch_size = batch_size
        # Keyed by (id, attempt): a message this relay lost and claimed again runs twice for a while.
        self.inflight: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._by_queue: Counter[str] = Counter()
        # Claims this process made whose attempt has not begun, as (id, attempt): the only
        # claims it may ever hand back uncharged. A row another process left running (even
        # one with the same relay id) is never among them; it leaves through lease expiry.
        self._unstarted: dict[tuple[int, int], None] = {}
        self._saturated = False
        self._positions = ClaimPositions(poll_interval=rt.poll_interval)
        self._listening = listening
        # (id, attempt) -> (queue, priority, grouped) of each claim until its outcome is written:
        # where in its queue a retry or the group's next message becomes claimable.
        self._placed: dict[tuple[int, int], tuple[str, int, bool]] = {}
        self._known_queues: set[str] = {r.queue for r in rt.routes.values()}
        self._next_discovery = 0.0
        self._scans = BesideTheClaims(rt, self._positions, self._known_queues)
        # Claims are as durable as outcomes: a claim a server crash forgot would have its
        # attempt number used again, and a delivery its handler already made would leave no
        # trace (no lease ever expires for it), so the duplicate could not be explained.
        self._conn = LoopConnection(rt.store.engine, settings=HOT_PATH) if rt.store.fast else None
        self._handler_pool = DaemonPool(concurrency + 2)
        #: Routes whose handler takes a claim's messages at once (``batch.py``), asked once per run.
        self._batch_routes = batch_routes(rt.routes)
        writer.on_written = self._slots_freed
        writer.deliveries_running = self.inflight.__len__
        writer.min_batch = max(1, batch_size // 2)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The delivery tasks running: one per message, or one for each batch's messages."""
        return list(dict.fromkeys(self.inflight.values()))

    def held_ids(self) -> list[int]:
        """Messages this relay works on (or must still release): their leases must be renewed."""
        return [*(message_id for message_id, _ in self.inflight), *(i for i, _ in self._unstarted)]

    def unstarted(self) -> list[tuple[int, int]]:
        """Claims whose attempt never began, as (id, attempt): to be released, uncharged."""
        return list(self._unstarted)

    def released(self, claims: list[tuple[int, int]]) -> None:
        for claim in claims:
            self._unstarted.pop(claim, None)
            self._placed.pop(claim, None)

    def learn_queues(self, queues: tuple[str, ...]) -> None:
        self._known_queues.update(queues)

    async def close(self) -> None:
        self._scans.cancel()
        if self._conn is not None:
            await self._conn.close()
        self._handler_pool.shutdown(wait=False)

    # -- claiming -----------------------------------------------------------------

    def _free(self, queue: str) -> int:
        # Outcomes not yet written hold their slot: if the database falls behind, the
        # relay claims less instead of piling up results in memory.
        free = self._concurrency - len(self.inflight) - len(self._writer)
        limit = self._queue_concurrency.get(queue)
        if limit is not None:
            free = min(free, limit - self._by_queue[queue])
        return free

    def _worth_a_claim(self, queue: str) -> int:
        """Free slots a claim waits for while earlier work is still under way.

        Handlers that finish one by one (a broker confirm, an HTTP response) free
        one slot at a time; claiming each slot alone would cost a statement per
        message on both sides. So a busy relay waits until half a batch is free,
        like a consumer's prefetch low-water mark. An idle one claims at once:
        nothing else would wake it, and a lone event must not wait.
        """
        if not self.inflight and not len(self._writer):
            return 1
        batch = min(self._batch_size, self._queue_concurrency.get(queue, self._batch_size))
        return max(1, batch // 2)

    def _slots_freed(self, batch: list[Outcome]) -> None:
        # Always a new claim round, saturated or not: a written outcome may also unblock
        # the next message of its group, which no NOTIFY announces.
        for _, completion in batch:
            placed = self._placed.pop((completion.message_id, completion.attempt), None)
            if placed is None:
                continue
            queue, priority, grouped = placed
            position = (priority, completion.message_id)
            if completion.status == "pending":
                self._positions.due_at(queue, position, completion.retry_in)
            elif grouped:
                self._positions.lower(queue, position)
        self._rt.wake.set()

    def heard(self, payload: str) -> None:
        """A NOTIFY: ``<schema> <priority> <id> <queue>`` names where a commit's rows sort (outbox_0023).

        Any other payload (an operator's action, a release, an older trigger)
        names no position: every queue is claimed from the front next. A
        payload that names another schema is another outbox sharing the
        channel in this database: its rows are not this relay's, and it is
        ignored (``'released'`` alone, from relays before the schema was
        named, is taken as this schema's).
        """
        rest = of_schema(payload, self._rt.store.notify_schema)
        if rest is None:
            return
        position = named_position(rest)
        if position is None:
            self._positions.rewind()
        else:
            queue, start = position
            self._positions.lower(queue, start)
            if self._queues is None:
                self._known_queues.add(queue)
        self._rt.wake.set()

    def rewind(self) -> None:
        """Leases recovered, or a LISTEN connection (re)opened: claim every queue from the front next."""
        self._positions.rewind()

    async def _queues_to_claim(self, discover: bool) -> list[str]:
        if self._queues is not None:
            return list(self._queues)
        # Discovery finds queues named only at emit time; once per poll interval is
        # enough, and keeps a query off the wake-up path.
        if discover and time.monotonic() >= self._next_discovery:
            self._next_discovery = time.monotonic() + self._rt.poll_interval
            if not self._positions.held:
                self._known_queues.update(await self._rt.db(self._rt.store.pending_queues))
            else:  # beside the claims: the walk starts at the front of the claim index
                self._scans.discover()
        return sorted(self._known_queues)

    async def claim_round(self, *, discover: bool) -> tuple[int, bool]:
        """Claim from every served queue up to the free slots.

        Returns how many were claimed, and whether more may be due right now
        (a full batch came back and slots are still free).
        """
        rt = self._rt
        more = False
        claimed = 0
        self._saturated = False
        self._positions.hold(self._listening())
        for queue in await self._queues_to_claim(discover):
            if rt.stopping:
                break
            self._scans.look_behind(queue)
            free = self._free(queue)
            if free < self._worth_a_claim(queue):
                self._saturated = True
                continue
            limit = min(self._batch_size, free)
            taken = await self._claim(queue, limit)
            claimed += taken
            if taken == limit:
                more = True
                if self._free(queue) <= 0:
                    self._saturated = True
        return claimed, more and not self._saturated

    async def _claim(self, queue: str, limit: int) -> int:
        """Claim and start up to ``limit`` rows of ``queue``, from its position (``claim_position.py``).

        A relay that does not listen keeps a position only while a backlog
        lasts: when the backlog after it ran out, what sorts before it may be
        due now and no NOTIFY would announce it, so a claim from the front
        takes the rest. A listening relay hears of those and moves its
        position back instead. Each statement's rows are started before the
        next statement, so a failure of the second leaves the first one's rows
        in flight, not held until their leases run out.
        """
        start = self._positions.start(queue)
        if start == END:  # nothing claimable after the last claim, and nothing heard since
            return 0
        taken = await self._claim_from(queue, limit, start)
        if start is not None and taken < limit and not self._positions.held:
            taken += await self._claim_from(queue, limit - taken, None)
        return taken

    async def _claim_from(self, queue: str, limit: int, start: Position) -> int:
        rt = self._rt
        began = rt.tracing.clock()
        timer = time.perf_counter()
        if self._conn is not None:
            rows = await rt.store.claim_on(self._conn, queue, rt.handlers, limit, start)
        else:
            rows = await rt.db(rt.store.claim, queue, rt.handlers, limit, start)
        self._positions.claimed(queue, start, rows, limit, time.perf_counter() - timer)
        if rows:
            rt.tracing.claimed(queue, len(rows), began)
            self._dispatch(queue, rows)
        return len(rows)

    def _dispatch(self, queue: str, rows: list[Any]) -> None:
        log.debug(
            "claimed %d from %s",
            len(rows),
            queue,
            extra={"action": "claim", "queue": queue, "count": len(rows)},
        )
        for row in rows:  # before anything else can fail or be interrupted
            self._unstarted[row.id, row.attempts] = None
            self._placed[row.id, row.attempts] = (queue, row.priority, row.group_key is not None)
        if signals.message_claimed.receivers:  # no Message objects to build when nobody listens
            send(
                signals.message_claimed,
                self._rt.outbox,
                relay=self._rt.sender,
                messages=[to_message(r) for r in rows],
            )
        batches: dict[str, list[Any]] = {}
        singles = []
        for row in rows:
            if row.handler in self._batch_routes:
                batches.setdefault(row.handler, []).append(row)
            else:
                singles.append(row)
        for row, deadline in zip(singles, self._deadlines(singles), strict=True):
            self._by_queue[queue] += 1
            task = asyncio.create_task(self._deliver(queue, row, deadline), name=f"outbox-message-{row.id}")
            self.inflight[row.id, row.attempts] = task
        for name, batch in batches.items():
            self._by_queue[queue] += len(batch)
            task = asyncio.create_task(self._deliver_batch(queue, name, batch), name=f"outbox-batch-{name}")
            for row in batch:
                self.inflight[row.id, row.attempts] = task

    def _deadlines(self, rows: list[Any]) -> list[Deadline]:
        """Each row's Deadline: the rows of one route timeout share one (relay/deadline.py)."""
        timeouts = [self._rt.routes[row.handler].timeout for row in rows]
        shared = {timeout: Deadline(self._rt.loop, timeout, n) for timeout, n in Counter(timeouts).items()}
        return [shared[timeout] for timeout in timeouts]

    # -- delivering ---------------------------------------------------------------

    async def _deliver(self, queue: str, row: Any, deadline: Deadline) -> None:
        rt = self._rt
        try:
            if rt.stopping:
                deadline.skip()
                return  # stays unstarted: the shutdown releases it
            self._unstarted.pop((row.id, row.attempts), None)
            route = rt.routes[row.handler]
            if expired(row):  # too late for anyone to see it: discarded, with the time it expired
                deadline.skip()
                self._writer.add(*expired_outcome(row))
                return
            unusable = undecodable(row)
            if unusable is not None:  # never the handler's to see: dead, with the reason
                deadline.skip()
                self._writer.add(*undecodable_outcome(row, unusable))
                return
            try:
                with rt.tracing.process(queue, row) as traced:  # current while the handler runs
                    message, completion = await attempt(
                        route,
                        row,
                        executor=self._handler_pool,
                        redactor=rt.redactor,
                        rng=rt.rng,
                        is_async=route.name in rt.async_routes,
                        deadline=deadline,
                    )
                    traced.outcome(completion)
            except asyncio.CancelledError:
                message, completion = cut_off(row, "Cancelled", CANCELLED)
            except Exception as exc:  # a relay bug must not leave a started attempt without its outcome
                log.error(
                    "attempt of message #%d could not be classified",
                    row.id,
                    exc_info=True,
                    extra={"action": "relay_error", "message_id": row.id, "handler": row.handler},
                )
                message, completion = cut_off(
                    row, "RelayError", f"the relay failed while running this attempt ({type(exc).__name__})"
                )
            self._writer.add(message, completion)
        finally:
            self.inflight.pop((row.id, row.attempts), None)
            self._by_queue[queue] -= 1
            if self._saturated:
                rt.wake.set()

    async def _deliver_batch(self, queue: str, name: str, rows: list[Any]) -> None:
        """One call for the rows a claim took for a batch route, under the route's timeout."""
        rt = self._rt
        route = rt.routes[name]
        deadline = Deadline(rt.loop, route.timeout, 1)
        try:
            if rt.stopping:
                deadline.skip()
                return  # they stay unstarted: the shutdown releases them
            for row in rows:
                self._unstarted.pop((row.id, row.attempts), None)
            fn, is_async = self._batch_routes[name]
            await deliver_batch(
                rt,
                route,
                queue,
                rows,
                fn=fn,
                is_async=is_async,
                deadline=deadline,
                executor=self._handler_pool,
                add=self._writer.add,
            )
        finally:
            for row in rows:
                self.inflight.pop((row.id, row.attempts), None)
            self._by_queue[queue] -= len(rows)
            if self._saturated:
                rt.wake.set()
