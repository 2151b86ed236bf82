"""One source's side of the runtime: what ``take``, ``refuse`` and the rest do for its messages.

Each message's transaction runs in a worker thread (the inbox's handlers are
plain functions, and a database round trip must never stall the broker
connection's heartbeats on the event loop). The acknowledgement runs on the
loop, after the commit, because that is where the broker clients live.

Failures are counted here as well as by the broker: RabbitMQ's classic queues
and Kafka do not count deliveries, so without this a message whose handler
always fails would come back forever instead of becoming a dead letter at the
inbox's ``max_failures``. The count is the larger of the broker's and this
process's, and is forgotten when the message is committed. A delivery that ended in a
database error is taken off the broker's count: the handlers never ran, and
an outage of the consumer's own database must not use up a message's
attempts (what an outage costs, on the consuming side too, is time).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from outbox import HandlerFailed, Inbox, InboxMessage, Processed
from outbox._backoff import Backoff
from outbox._first_line import first_line
from outbox._inbox.sessions import Sessions, open_session
from outbox._inbox.source import Ack, BeforeCommit, InboxSource

from .tracing import traced

if TYPE_CHECKING:
    from .metrics import ConsumerMetrics

__all__ = ["Runtime", "SourceRun"]

log = logging.getLogger("outbox.consumer")

#: Message ids whose failures are remembered at most (the oldest are forgotten first).
FAILURES_KEPT = 10_000


class Runtime:
    """What every source of one consumer process shares: the inbox, sessions, threads, counters."""

    def __init__(
        self,
        inbox: Inbox,
        sessions: Sessions,
        *,
        concurrency: int,
        backoff: Backoff,
        metrics: ConsumerMetrics | None,
    ) -> None:
        self.inbox = inbox
        self.sessions = sessions
        self.concurrency = concurrency
        self.backoff = backoff
        self.metrics = metrics
        self.stopping = asyncio.Event()
        self.executor = ThreadPoolExecutor(concurrency, thread_name_prefix="outbox-consumer")
        self.failures: OrderedDict[str, int] = OrderedDict()
        #: Deliveries of a message that ended in a database error: the broker counted them, the
        #: inbox must not, or an outage of the consumer's own database would use up attempts.
        self.uncounted: OrderedDict[str, int] = OrderedDict()
        self.connected: dict[str, bool] = {}
        self.tracer_provider = inbox.outbox.tracer_provider if inbox.outbox is not None else None

    def database_ok(self) -> None:
        if self.metrics is not None:
            self.metrics.database_ok()

    def failed(self, message_id: str, attempt: int) -> None:
        _remember(self.failures, message_id, attempt)

    def not_counted(self, message_id: str) -> None:
        _remember(self.uncounted, message_id, self.uncounted.get(message_id, 0) + 1)

    def forget(self, message_id: str) -> None:
        self.failures.pop(message_id, None)
        self.uncounted.pop(message_id, None)

    async def in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def _remember(counts: OrderedDict[str, int], message_id: str, value: int) -> None:
    counts[message_id] = value
    counts.move_to_end(message_id)
    while len(counts) > FAILURES_KEPT:
        counts.popitem(last=False)


def _system(source: InboxSource) -> str:
    """``messaging.system`` for spans: the part of the source's name before its first colon."""
    return source.name.partition(":")[0] or "unknown"


async def _call(ack: Ack) -> None:
    answer = ack()
    if inspect.isawaitable(answer):
        await answer


class SourceRun:
    """The :class:`~outbox._inbox.source.SourceContext` one source gets, each time it is started."""

    def __init__(self, runtime: Runtime, source: InboxSource) -> None:
        self._rt = runtime
        self._source = source
        self._name = source.name
        self._system = _system(source)

    @property
    def inbox(self) -> Inbox:
        return self._rt.inbox

    @property
    def stopping(self) -> asyncio.Event:
        return self._rt.stopping

    @property
    def concurrency(self) -> int:
        return self._rt.concurrency

    async def stored_offsets(self, topic: str) -> dict[int, int]:
        rt = self._rt

        def read() -> dict[int, int]:
            with open_session(rt.sessions) as session:
                return rt.inbox.stored_offsets(session, topic)

        found: dict[int, int] = await rt.in_thread(read)
        rt.database_ok()
        return found

    def retry_delay(self, attempt: int) -> float:
        return self._rt.backoff.delay(max(attempt, 1))

    def connected(self, up: bool) -> None:
        rt = self._rt
        if rt.connected.get(self._name) != up:
            log.info(
                "source %s %s",
                self._name,
                "connected" if up else "lost its connection",
                extra={"action": "source_up" if up else "source_down", "source": self._name},
            )
        rt.connected[self._name] = up
        if rt.metrics is not None:
            rt.metrics.source_connected(rt.inbox.name, self._name, up)

    def _counted(self, message: InboxMessage) -> InboxMessage:
        """The attempt the inbox counts: the broker's, less database errors, at least this process's."""
        rt = self._rt
        attempt = max(message.attempt - rt.uncounted.get(message.id, 0), 1)
        attempt = max(attempt, rt.failures.get(message.id, 0) + 1)
        if attempt != message.attempt:
            return dataclasses.replace(message, attempt=attempt)
        return message

    def _count(self, outcome: str, started: float | None = None) -> None:
        metrics = self._rt.metrics
        if metrics is None:
            return
        inbox = self._rt.inbox.name
        metrics.messages.labels(inbox, self._name, outcome).inc()
        if started is not None:
            metrics.duration.labels(inbox, self._name).observe(time.perf_counter() - started)

    def _in_flight(self, change: int) -> None:
        if self._rt.metrics is not None:
            self._rt.metrics.in_flight.labels(self._rt.inbox.name, self._name).inc(change)

    async def take(
        self, message: InboxMessage, *, ack: Ack | None = None, before_commit: BeforeCommit | None = None
    ) -> Processed | None:
        rt = self._rt
        message = self._counted(message)
        inbox = rt.inbox

        def work() -> Processed:
            return inbox.process(rt.sessions, message, before_commit=before_commit)

        started = time.perf_counter()
        self._in_flight(1)
        try:
            result: Processed = await rt.in_thread(
                traced, inbox.name, self._system, message, work, rt.tracer_provider
            )
        except HandlerFailed as failed:
            rt.failed(message.id, message.attempt)
            rt.database_ok()
            self._count("failed", started)
            log.warning(
                "inbox %s: %s failed on message %s (%s), attempt %d: %s; it will come again",
                inbox.name,
                failed.handler or "flushing the handlers' changes",
                message.id,
                message.event_type,
                message.attempt,
                first_line(failed.__cause__ or failed),
                extra={"action": "inbox_failed", "source": self._name, "message_id": message.id},
            )
            return None
        except Exception as error:  # the database, or the source's before_commit: nothing is stored
            rt.not_counted(message.id)
            self._count("error", started)
            log.error(
                "inbox %s: message %s from %s not processed: %s; it will come again",
                inbox.name,
                message.id,
                self._name,
                first_line(error),
                extra={"action": "inbox_error", "source": self._name, "message_id": message.id},
            )
            return None
        finally:
            self._in_flight(-1)
        rt.forget(message.id)
        rt.database_ok()
        self._count(result.outcome, started)
        if ack is not None:
            await self._ack(ack, message)
        return result

    async def _ack(self, ack: Ack, message: InboxMessage) -> None:
        try:
            await _call(ack)
        except Exception as error:
            if self._rt.metrics is not None:
                self._rt.metrics.acks_failed.labels(self._rt.inbox.name, self._name).inc()
            log.warning(
                "inbox %s: message %s is committed but its acknowledgement to %s failed: %s; "
                "its redelivery will be a duplicate",
                self._rt.inbox.name,
                message.id,
                self._name,
                first_line(error),
                extra={"action": "ack_failed", "source": self._name, "message_id": message.id},
            )

    async def refuse(
        self,
        message: InboxMessage,
        error: BaseException,
        *,
        ack: Ack | None = None,
        before_commit: BeforeCommit | None = None,
    ) -> bool:
        rt = self._rt
        inbox = rt.inbox

        def bury() -> int | None:
            with open_session(rt.sessions) as session, session.begin():
                dead_id = inbox.dead_letter(session, message, error)
                if before_commit is not None:
                    before_commit(session)
                return dead_id

        try:
            dead_id = await rt.in_thread(bury)
        except Exception as failure:
            self._count("error")
            log.error(
                "inbox %s: cannot record undecodable message %s from %s as a dead letter: %s; "
                "it will come again",
                inbox.name,
                message.id,
                self._name,
                first_line(failure),
                extra={"action": "inbox_error", "source": self._name, "message_id": message.id},
            )
            return False
        rt.database_ok()
        self._count("dead" if dead_id is not None else "duplicate")
        if dead_id is not None:
            log.warning(
                "inbox %s: message %s from %s recorded as dead letter %s: %s",
                inbox.name,
                message.id,
                self._name,
                dead_id,
                first_line(error),
                extra={"action": "inbox_dead", "source": self._name, "message_id": message.id},
            )
        if ack is not None:
            await self._ack(ack, message)
        return True
