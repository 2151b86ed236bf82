"""The Inbox: a consumer's name, window and handlers, and every call a consumer or a source makes."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from .._exceptions import ConfigurationError
from . import offsets
from .checks import check_message, check_message_id, check_sent_at, check_text
from .dead import bury, bury_async
from .handlers import InboxHandler
from .markers import mark, mark_async
from .message import InboxMessage, Processed
from .process import process, process_async
from .requeue import process_requeued, process_requeued_async
from .sessions import AsyncSessions, Sessions
from .settings import DEFAULT_KEEP, DEFAULT_MAX_FAILURES, InboxSettings, Unhandled
from .source import InboxSource

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

    from .._outbox import Outbox

__all__ = ["Inbox"]

F = TypeVar("F", bound=Callable[..., Any])


class Inbox:
    """One consumer's inbox: its name, how long it keeps markers, and its handlers.

    ``name`` is stored with every marker (``outbox_inbox.consumer``): two
    inboxes with different names each take a message once, and one name shared
    by several processes takes it once among them all. Keep it stable.

    ``keep`` is how long a marker is kept (at least: the purge removes it some
    time after); a message sent longer ago than that is refused
    (:class:`~outbox.MessageTooOld`). ``max_failures``: the attempt whose
    failure makes a message a dead letter in :meth:`process` (None: never, the
    caller decides). ``unhandled``: what :meth:`process` does with a message
    no handler matches: ``"dead_letter"`` records it as a dead letter (seen,
    and requeue-able once a handler exists), ``"skip"`` marks it ``unhandled``
    and lets it go.

    ``outbox``: the :class:`~outbox.Outbox` whose ``emit()`` the handlers
    call. ``outbox-consumer`` installs it on the sessions it makes; an
    application that passes its own sessionmaker installs it itself.
    """

    def __init__(
        self,
        name: str,
        *,
        keep: timedelta = DEFAULT_KEEP,
        max_failures: int | None = DEFAULT_MAX_FAILURES,
        unhandled: Unhandled = "dead_letter",
        outbox: Outbox | None = None,
    ) -> None:
        from .._outbox import Outbox

        if outbox is not None and not isinstance(outbox, Outbox):
            raise ConfigurationError(f"inbox {name!r}: outbox must be an outbox.Outbox, got {outbox!r}")
        self._settings = InboxSettings(name, keep, max_failures, unhandled)
        self._outbox = outbox
        self._sources: list[InboxSource] = []

    @property
    def name(self) -> str:
        return self._settings.name

    @property
    def keep(self) -> timedelta:
        return self._settings.keep

    @property
    def max_failures(self) -> int | None:
        return self._settings.max_failures

    @property
    def unhandled(self) -> Unhandled:
        return self._settings.unhandled

    @property
    def outbox(self) -> Outbox | None:
        return self._outbox

    # -- sources ----------------------------------------------------------------------------------

    def consume(self, *sources: InboxSource) -> None:
        """Attach broker consumers (``RabbitMQConsumer``, ``NatsConsumer``, ``KafkaConsumer``...).

        ``outbox-consumer --app module:inbox`` (or ``outbox.consumer.Consumer``)
        runs every source attached here. Two sources of one name are refused:
        the name keys their metrics and logs.
        """
        taken = {source.name for source in self._sources}
        for source in sources:
            if not isinstance(source, InboxSource):
                raise ConfigurationError(
                    f"inbox {self.name!r}: consume() takes sources such as outbox.integrations.rabbitmq."
                    f"RabbitMQConsumer, got {type(source).__name__}"
                )
            if source.name in taken:
                raise ConfigurationError(f"inbox {self.name!r} has a source named {source.name!r} already")
            taken.add(source.name)
            self._sources.append(source)

    @property
    def sources(self) -> tuple[InboxSource, ...]:
        return tuple(self._sources)

    def __repr__(self) -> str:
        return f"Inbox({self.name!r}, keep={self.keep!r}, handlers={len(self.handlers)})"

    # -- handlers ---------------------------------------------------------------------------------

    def handler(self, event_type: str, *, name: str | None = None) -> Callable[[F], F]:
        """Register ``fn(session, message)`` for event types matching ``event_type``.

        ``*`` in the pattern matches one dot-separated word, ``#`` any number
        (``order.*``, ``order.#``). A message reaches every handler it
        matches, in the order they were registered, all in one transaction
        with its marker. ``name`` defaults to the function's import path.
        """

        def register(fn: F) -> F:
            self._settings.handlers.add(event_type, fn, name)
            return fn

        return register

    @property
    def handlers(self) -> tuple[InboxHandler, ...]:
        return self._settings.handlers.all

    def handlers_for(self, event_type: str) -> tuple[InboxHandler, ...]:
        """The handlers a message of ``event_type`` reaches, in registration order."""
        return self._settings.handlers.matching(event_type)

    # -- markers ----------------------------------------------------------------------------------

    def _checked(
        self, message_id: Any, event_type: Any, source: Any, sent_at: Any
    ) -> tuple[str, str | None, str | None]:
        message_id = check_message_id(message_id)
        event_type = check_text("event_type", event_type, required=False)
        source = check_text("source", source, required=False)
        refused = self._settings.too_old(message_id, check_sent_at(sent_at))
        if refused is not None:
            raise refused
        return message_id, event_type, source

    def receive(
        self,
        session: Session | Connection,
        message_id: str | Any,
        *,
        event_type: str | None = None,
        source: str | None = None,
        sent_at: datetime | None = None,
    ) -> bool:
        """Write the message's marker in ``session``'s transaction: True the first time, False if a duplicate.

        Act on the message only when it returns True, and in the same
        transaction: the marker and the effects then commit or roll back
        together. Of two transactions that receive the same id at once,
        exactly one gets True. ``message_id`` is a non-empty string of at most
        255 characters (a UUID or an int is taken as its text). A ``sent_at``
        older than ``keep`` raises :class:`~outbox.MessageTooOld` before
        anything is written.
        """
        message_id, event_type, source = self._checked(message_id, event_type, source, sent_at)
        return mark(self._settings, session, message_id, "received", event_type=event_type, source=source)

    async def areceive(
        self,
        session: AsyncSession | AsyncConnection,
        message_id: str | Any,
        *,
        event_type: str | None = None,
        source: str | None = None,
        sent_at: datetime | None = None,
    ) -> bool:
        """:meth:`receive` with an ``AsyncSession`` (or ``AsyncConnection``)."""
        message_id, event_type, source = self._checked(message_id, event_type, source, sent_at)
        return await mark_async(
            self._settings, session, message_id, "received", event_type=event_type, source=source
        )

    # -- one message end to end -------------------------------------------------------------------

    def process(
        self,
        sessions: Sessions,
        message: InboxMessage,
        *,
        ack: Callable[[], object] | None = None,
        before_commit: Callable[[Session], object] | None = None,
    ) -> Processed:
        """Take one message end to end: marker and handlers in one transaction, commit, then ``ack()``.

        ``sessions`` is a sessionmaker (install the Outbox on it if handlers
        emit) or an Engine. Returns what was committed
        (:class:`~outbox.Processed`); ``ack`` runs only after the commit,
        whatever the outcome. Raises :class:`~outbox.HandlerFailed` when a
        handler failed and the message should come again (nothing was
        stored, ``ack`` was not called). ``before_commit(session)`` runs in
        the same transaction for every outcome, a duplicate's included: where
        a source stores its position.
        """
        return process(self._settings, sessions, message, ack=ack, before_commit=before_commit)

    async def aprocess(
        self,
        sessions: AsyncSessions,
        message: InboxMessage,
        *,
        ack: Callable[[], object] | None = None,
        before_commit: Callable[[AsyncSession], object] | None = None,
    ) -> Processed:
        """:meth:`process` with an ``async_sessionmaker`` or an ``AsyncEngine``.

        Async handlers get the ``AsyncSession``; plain ones run through
        ``session.run_sync`` and get its ``Session``. ``ack`` and
        ``before_commit`` may be coroutine functions.
        """
        return await process_async(self._settings, sessions, message, ack=ack, before_commit=before_commit)

    # -- dead letters -----------------------------------------------------------------------------

    def dead_letter(
        self, session: Session | Connection, message: InboxMessage, error: BaseException, *, attempts: int = 0
    ) -> int | None:
        """Record ``message`` as a dead letter in ``session``'s transaction, with its marker.

        Returns the dead letter's id, or None when the message's marker was
        there already (taken, or buried, before): then nothing is written.
        ``attempts`` is how many times a handler ran it. Acknowledge the
        message to its source only after this commits.
        """
        return bury(self._settings, session, check_message(message), error, attempts)

    async def adead_letter(
        self,
        session: AsyncSession | AsyncConnection,
        message: InboxMessage,
        error: BaseException,
        *,
        attempts: int = 0,
    ) -> int | None:
        """:meth:`dead_letter` with an ``AsyncSession`` (or ``AsyncConnection``)."""
        return await bury_async(self._settings, session, check_message(message), error, attempts)

    def process_requeued(self, sessions: Sessions, *, limit: int = 100) -> list[Processed]:
        """Take up the dead letters an operator requeued, oldest first (at most ``limit``); each outcome.

        Each runs its matching handlers in one transaction that also marks it
        ``handled`` (only if it is still requeued: of several processes, one
        takes it), with ``attempt`` one more than its dead letter's
        ``attempts``. Handlers that fail, or none matching, make it ``dead``
        again with the new error: it is tried once per requeue. Outcomes are
        ``handled``, ``dead``, or ``duplicate`` (another process has it);
        ``dead_letter_id`` names the dead letter. Its marker stays ``dead``.
        """
        return process_requeued(self._settings, sessions, limit=limit)

    async def aprocess_requeued(self, sessions: AsyncSessions, *, limit: int = 100) -> list[Processed]:
        """:meth:`process_requeued` with an ``async_sessionmaker`` or an ``AsyncEngine``."""
        return await process_requeued_async(self._settings, sessions, limit=limit)

    # -- positions in a partitioned log -----------------------------------------------------------

    def store_offset(
        self, session: Session | Connection, topic: str, partition: int, next_offset: int
    ) -> None:
        """Store where this consumer resumes in ``topic``'s ``partition``, in ``session``'s transaction.

        Call it in the transaction of the record before ``next_offset`` (for
        instance from ``process(..., before_commit=...)``). An offset smaller
        than the one stored leaves it as it is.
        """
        offsets.store(self.name, session, topic, partition, next_offset)

    async def astore_offset(
        self, session: AsyncSession | AsyncConnection, topic: str, partition: int, next_offset: int
    ) -> None:
        """:meth:`store_offset` with an ``AsyncSession`` (or ``AsyncConnection``)."""
        await offsets.store_async(self.name, session, topic, partition, next_offset)

    def stored_offsets(self, bind: Session | Connection | Engine, topic: str) -> dict[int, int]:
        """``{partition: next offset}`` stored for ``topic``; a partition never stored is absent."""
        return offsets.stored(self.name, bind, topic)

    async def astored_offsets(
        self, bind: AsyncSession | AsyncConnection | AsyncEngine, topic: str
    ) -> dict[int, int]:
        """:meth:`stored_offsets` with an ``AsyncSession``, ``AsyncConnection`` or ``AsyncEngine``."""
        return await offsets.stored_async(self.name, bind, topic)
