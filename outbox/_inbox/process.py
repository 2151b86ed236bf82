"""One incoming message end to end: marker, handlers and commit in one transaction, then the ack.

What a source calls for each delivery. The order is what makes the effects
happen once:

1. the message is checked; one too old for the inbox's window, or that no
   handler takes (unless the inbox skips those), is recorded as a dead letter
   with its marker, committed, and acknowledged;
2. in one transaction: the marker; if it is new, every matching handler with
   ``(session, message)``, then a flush, so their changes fail here if they
   fail; the source's ``before_commit`` (a Kafka offset, say); the commit;
3. only then ``ack()``: a crash before it means a redelivery, which step 2
   answers as a duplicate.

A handler that raises rolls back the marker and every effect together, so a
redelivery runs the handlers again: :class:`~outbox.HandlerFailed` tells the
source to let it come back. When that was the ``max_failures``-th attempt, or
the handler raised ``PermanentError``, the message becomes a dead letter
instead (in a new transaction, with its marker) and is acknowledged. An error
of the database itself, or of ``before_commit``, is raised as it is: nothing
was committed and nothing counts against the message.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from sqlalchemy.orm import Session

from .._exceptions import AckFailed, ConfigurationError, HandlerFailed, PermanentError
from .._first_line import first_line
from .checks import check_message
from .dead import bury, bury_async
from .handlers import InboxHandler
from .markers import mark, mark_async
from .message import InboxMessage, Processed
from .sessions import AsyncSessions, Sessions, open_async_session, open_session
from .settings import InboxSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["Stage", "log", "process", "process_async"]

log = logging.getLogger("outbox.inbox")

Ack: TypeAlias = Callable[[], object]
BeforeCommit: TypeAlias = Callable[[Session], object]


class Stage:
    """Where a failure came from: a handler (by name), flushing their changes, or neither."""

    __slots__ = ("handler", "running")

    def __init__(self) -> None:
        self.running = False
        self.handler: str | None = None


def _gives_up(inbox: InboxSettings, message: InboxMessage, error: BaseException) -> bool:
    if isinstance(error, PermanentError):
        return True
    return inbox.max_failures is not None and message.attempt >= inbox.max_failures


def _refusal(
    inbox: InboxSettings, message: InboxMessage, handlers: tuple[InboxHandler, ...]
) -> Exception | None:
    """Why the message becomes a dead letter without any handler running, or None."""
    too_old = inbox.too_old(message.id, message.sent_at)
    if too_old is not None:
        return too_old
    if not handlers and inbox.unhandled == "dead_letter":
        return inbox.no_handler(message.event_type)
    return None


def _finished(inbox: InboxSettings, message: InboxMessage, result: Processed) -> Processed:
    extra = {
        "action": f"inbox_{result.outcome}",
        "inbox": inbox.name,
        "message_id": message.id,
        "event_type": message.event_type,
    }
    if result.outcome == "dead":
        log.warning(
            "inbox %s: message %s (%s) recorded as dead letter %s: %s",
            inbox.name,
            message.id,
            message.event_type,
            result.dead_letter_id,
            "" if result.error is None else first_line(result.error),
            extra=extra,
        )
    elif log.isEnabledFor(logging.DEBUG):
        log.debug("inbox %s: message %s %s", inbox.name, message.id, result.outcome, extra=extra)
    return result


def _acked(result: Processed, ack: Ack | None) -> Processed:
    if ack is not None:
        try:
            ack()
        except Exception as error:
            raise AckFailed(result, error) from error
    return result


async def _acked_async(result: Processed, ack: Ack | None) -> Processed:
    if ack is not None:
        try:
            answer = ack()
            if inspect.isawaitable(answer):
                await answer
        except Exception as error:
            raise AckFailed(result, error) from error
    return result


def _bury(
    inbox: InboxSettings,
    bind: Sessions,
    message: InboxMessage,
    error: BaseException,
    attempts: int,
    handlers: tuple[str, ...],
    before_commit: BeforeCommit | None,
) -> Processed:
    with open_session(bind) as session, session.begin():
        dead_id = bury(inbox, session, message, error, attempts)
        if before_commit is not None:
            before_commit(session)
    if dead_id is None:  # taken meanwhile, by another consumer or an earlier delivery
        return Processed(message.id, "duplicate")
    return Processed(message.id, "dead", handlers, error=error, dead_letter_id=dead_id)


def process(
    inbox: InboxSettings,
    bind: Sessions,
    message: InboxMessage,
    *,
    ack: Ack | None = None,
    before_commit: BeforeCommit | None = None,
) -> Processed:
    message = check_message(message)
    handlers = inbox.handlers.matching(message.event_type)
    for handler in handlers:
        if handler.is_async:
            raise ConfigurationError(
                f"inbox handler {handler.name!r} is a coroutine function: process messages with "
                "await inbox.aprocess(...), or make it a plain function"
            )
    names = tuple(h.name for h in handlers)
    refused = _refusal(inbox, message, handlers)
    if refused is not None:
        result = _bury(inbox, bind, message, refused, 0, names, before_commit)
        return _acked(_finished(inbox, message, result), ack)
    stage = Stage()
    try:
        with open_session(bind) as session, session.begin():
            first = mark(
                inbox,
                session,
                message.id,
                "handled" if handlers else "unhandled",
                event_type=message.event_type,
                source=message.source,
                what="process",
            )
            if first:
                stage.running = True
                for handler in handlers:
                    stage.handler = handler.name
                    handler.fn(session, message)
                stage.handler = None
                session.flush()
                stage.running = False
            if before_commit is not None:
                before_commit(session)
    except Exception as error:
        if not stage.running:
            raise
        if not _gives_up(inbox, message, error):
            raise HandlerFailed(message, stage.handler, error) from error
        result = _bury(inbox, bind, message, error, message.attempt, names, before_commit)
        return _acked(_finished(inbox, message, result), ack)
    if first:
        result = Processed(message.id, "handled" if handlers else "unhandled", names)
    else:
        result = Processed(message.id, "duplicate")
    return _acked(_finished(inbox, message, result), ack)


async def _call(fn: Callable[..., object], *args: Any) -> None:
    answer = fn(*args)
    if inspect.isawaitable(answer):
        await answer


async def _bury_async(
    inbox: InboxSettings,
    bind: AsyncSessions,
    message: InboxMessage,
    error: BaseException,
    attempts: int,
    handlers: tuple[str, ...],
    before_commit: Callable[[AsyncSession], object] | None,
) -> Processed:
    async with open_async_session(bind) as session, session.begin():
        dead_id = await bury_async(inbox, session, message, error, attempts)
        if before_commit is not None:
            await _call(before_commit, session)
    if dead_id is None:
        return Processed(message.id, "duplicate")
    return Processed(message.id, "dead", handlers, error=error, dead_letter_id=dead_id)


async def process_async(
    inbox: InboxSettings,
    bind: AsyncSessions,
    message: InboxMessage,
    *,
    ack: Callable[[], object] | None = None,
    before_commit: Callable[[AsyncSession], object] | None = None,
) -> Processed:
    message = check_message(message)
    handlers = inbox.handlers.matching(message.event_type)
    names = tuple(h.name for h in handlers)
    refused = _refusal(inbox, message, handlers)
    if refused is not None:
        result = await _bury_async(inbox, bind, message, refused, 0, names, before_commit)
        return await _acked_async(_finished(inbox, message, result), ack)
    stage = Stage()
    try:
        async with open_async_session(bind) as session, session.begin():
            first = await mark_async(
                inbox,
                session,
                message.id,
                "handled" if handlers else "unhandled",
                event_type=message.event_type,
                source=message.source,
                what="process",
            )
            if first:
                stage.running = True
                for handler in handlers:
                    stage.handler = handler.name
                    if handler.is_async:
                        await handler.fn(session, message)
                    else:  # on the session's own greenlet, so its SQL runs on this connection
                        await session.run_sync(handler.fn, message)
                stage.handler = None
                await session.flush()
                stage.running = False
            if before_commit is not None:
                await _call(before_commit, session)
    except Exception as error:
        if not stage.running:
            raise
        if not _gives_up(inbox, message, error):
            raise HandlerFailed(message, stage.handler, error) from error
        result = await _bury_async(inbox, bind, message, error, message.attempt, names, before_commit)
        return await _acked_async(_finished(inbox, message, result), ack)
    if first:
        result = Processed(message.id, "handled" if handlers else "unhandled", names)
    else:
        result = Processed(message.id, "duplicate")
    return await _acked_async(_finished(inbox, message, result), ack)
