"""What a broker consumer (a *source*) and the runtime that drives it promise each other.

A source knows its broker: how to fetch, how to acknowledge, how to ask for
a redelivery. The runtime (``outbox.consumer.Consumer``, and the
``outbox-consumer`` command) knows the inbox: it runs each message's
transaction in a worker thread, counts failures, keeps the metrics, traces,
and decides when to stop. The two meet here, so that a source written outside
this package (for a broker we do not ship) gets the same guarantees:

- a message is acknowledged only after its outcome is committed: the source
  hands the runtime an ``ack`` and the runtime calls it, never before;
- a message whose handler failed is not acknowledged: ``take`` answers None
  and the source asks its broker for a redelivery after ``retry_delay``;
- a message that cannot even be decoded is recorded as a dead letter
  (``refuse``) before it is acknowledged: nothing leaves unrecorded.

Core only: importing this module loads no broker client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeAlias, runtime_checkable

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .message import InboxMessage, Processed

__all__ = ["Ack", "BeforeCommit", "InboxSource", "InboxView", "SourceContext"]

#: Acknowledges one delivery to its broker; may be a coroutine function.
Ack: TypeAlias = Callable[[], "object | Awaitable[object]"]
#: Runs in the message's transaction, for every outcome, before the commit (a Kafka offset).
BeforeCommit: TypeAlias = Callable[[Session], object]


class InboxView(Protocol):
    """What a source may use of the :class:`~outbox.Inbox` it feeds: its name and its log positions."""

    @property
    def name(self) -> str: ...

    def store_offset(
        self, session: Session | Connection, topic: str, partition: int, next_offset: int
    ) -> None: ...

    def stored_offsets(self, bind: Session | Connection | Engine, topic: str) -> dict[int, int]: ...


class SourceContext(Protocol):
    """What the runtime gives a source's :meth:`InboxSource.consume`."""

    @property
    def inbox(self) -> InboxView: ...

    @property
    def stopping(self) -> asyncio.Event:
        """Set on shutdown: fetch nothing more, let the messages in hand finish, then return."""
        ...

    @property
    def concurrency(self) -> int:
        """How many of this source's messages may be in hand at once (a prefetch count)."""
        ...

    async def take(
        self, message: InboxMessage, *, ack: Ack | None = None, before_commit: BeforeCommit | None = None
    ) -> Processed | None:
        """Process one message, then call ``ack``; the committed outcome, or None to redeliver.

        None means nothing was stored and ``ack`` was not called: a handler
        failed (and this was not its last attempt) or the database could not
        be reached. The source lets the message come again, no sooner than
        :meth:`retry_delay` of its attempt. A committed outcome whose ``ack``
        raised is logged and returned: the redelivery will be a duplicate.
        """
        ...

    async def refuse(
        self,
        message: InboxMessage,
        error: BaseException,
        *,
        ack: Ack | None = None,
        before_commit: BeforeCommit | None = None,
    ) -> bool:
        """Record a message the source could not decode as a dead letter, commit, then ``ack``.

        ``before_commit`` runs in the dead letter's transaction, as with
        :meth:`take` (a Kafka offset). False when the database could not
        record it: nothing was acknowledged, and the source lets the message
        come again.
        """
        ...

    async def stored_offsets(self, topic: str) -> dict[int, int]:
        """``{partition: next offset}`` the inbox stored for ``topic`` (a Kafka source's assignment)."""
        ...

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait before the delivery after failed ``attempt`` (capped backoff with jitter)."""
        ...

    def connected(self, up: bool) -> None:
        """Tell readiness whether the source holds a working connection to its broker."""
        ...


@runtime_checkable
class InboxSource(Protocol):
    """A broker consumer that feeds an :class:`~outbox.Inbox`: attach with ``inbox.consume(source)``.

    ``name`` names it in logs and metrics (``rabbitmq:orders``). ``consume``
    runs until ``context.stopping`` is set and the messages it has in hand are
    finished, and reconnects on its own through a broker's outage; an
    exception it lets out is logged and the runtime starts it again after a
    pause, except :class:`~outbox.ConfigurationError`, which stops the
    consumer at start-up with its one line.
    """

    @property
    def name(self) -> str: ...

    def consume(self, context: SourceContext) -> Awaitable[None]: ...
