"""Requeued dead letters taken up again: each in one transaction with its handlers, or dead once more.

What ``Inbox.process_requeued`` does with the dead letters an operator
requeued (``outbox inbox requeue``), oldest first, each on its own:

1. one transaction: the dead letter is taken (``requeued`` → ``handled``,
   only if it is still requeued and no other transaction holds it), every
   handler its event type matches runs with the message rebuilt from the
   row (``attempt`` = the dead letter's ``attempts`` + 1), a flush, the
   commit: the mark and the effects commit together, or neither;
2. a handler that raises (any error, ``PermanentError`` or not) rolls all of
   it back, and a new transaction makes the dead letter ``dead`` again with
   the new error and one more attempt: a requeue is tried once, so it never
   loops; the operator decides again;
3. still no handler for its type: ``dead`` again at once, with
   ``NoInboxHandler``, no attempt counted.

The message's marker (``outbox_inbox``) is never changed: it keeps saying
``dead``, which is what makes the broker's redeliveries duplicates, while the
dead letter's status says ``handled``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._exceptions import ConfigurationError
from .._first_line import first_line
from .handlers import InboxHandler
from .message import Processed
from .process import Stage, log
from .requeued import (
    DEAD_BIND,
    Requeued,
    check_limit,
    dead_again,
    dead_again_async,
    read,
    read_async,
    take,
    take_async,
)
from .sessions import (
    AsyncSessions,
    Sessions,
    async_connection_of,
    connection_of,
    open_async_session,
    open_session,
)
from .settings import InboxSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["process_requeued", "process_requeued_async"]

_WHAT = "process_requeued"


def _reported(inbox: InboxSettings, letter: Requeued, result: Processed) -> Processed:
    message = letter.message
    extra = {
        "action": f"inbox_requeued_{result.outcome}",
        "inbox": inbox.name,
        "message_id": message.id,
        "event_type": message.event_type,
        "dead_letter_id": letter.dead_id,
    }
    if result.outcome == "dead":
        log.warning(
            "inbox %s: requeued dead letter %s (message %s, %s) is dead again: %s",
            inbox.name,
            letter.dead_id,
            message.id,
            message.event_type,
            "" if result.error is None else first_line(result.error),
            extra=extra,
        )
    elif result.outcome == "handled":
        log.info(
            "inbox %s: requeued dead letter %s (message %s, %s) handled",
            inbox.name,
            letter.dead_id,
            message.id,
            message.event_type,
            extra=extra,
        )
    elif log.isEnabledFor(logging.DEBUG):
        log.debug(
            "inbox %s: requeued dead letter %s taken by another transaction",
            inbox.name,
            letter.dead_id,
            extra=extra,
        )
    return result


def _outcome(letter: Requeued, taken: bool, names: tuple[str, ...]) -> Processed:
    if taken:
        return Processed(letter.message.id, "handled", names, dead_letter_id=letter.dead_id)
    # Handled, or put back, by another transaction meanwhile; or held by one right now.
    return Processed(letter.message.id, "duplicate", dead_letter_id=letter.dead_id)


def _buried(letter: Requeued, again: bool, names: tuple[str, ...], error: BaseException) -> Processed:
    if not again:  # another consumer process took it meanwhile, or put it back first
        return Processed(letter.message.id, "duplicate", dead_letter_id=letter.dead_id)
    return Processed(letter.message.id, "dead", names, error=error, dead_letter_id=letter.dead_id)


def _dead_again(
    inbox: InboxSettings,
    bind: Sessions,
    letter: Requeued,
    error: BaseException,
    names: tuple[str, ...],
    *,
    counted: bool,
) -> Processed:
    with open_session(bind, _WHAT) as session, session.begin():
        connection = connection_of(session, _WHAT, DEAD_BIND)
        again = dead_again(connection, inbox.name, letter.dead_id, error, counted=counted)
    return _buried(letter, again, names, error)


def _sync_handlers(inbox: InboxSettings, letter: Requeued) -> tuple[InboxHandler, ...]:
    handlers = inbox.handlers.matching(letter.message.event_type)
    for handler in handlers:
        if handler.is_async:
            raise ConfigurationError(
                f"inbox handler {handler.name!r} is a coroutine function: take requeued dead letters with "
                "await inbox.aprocess_requeued(...), or make it a plain function"
            )
    return handlers


def _one(inbox: InboxSettings, bind: Sessions, letter: Requeued) -> Processed:
    handlers = _sync_handlers(inbox, letter)
    names = tuple(h.name for h in handlers)
    message = letter.message
    if not handlers:
        return _dead_again(inbox, bind, letter, inbox.no_handler(message.event_type), names, counted=False)
    stage = Stage()
    try:
        with open_session(bind, _WHAT) as session, session.begin():
            taken = take(connection_of(session, _WHAT, DEAD_BIND), inbox.name, letter.dead_id)
            if taken:
                stage.running = True
                for handler in handlers:
                    stage.handler = handler.name
                    handler.fn(session, message)
                stage.handler = None
                session.flush()
                stage.running = False
    except Exception as error:
        if not stage.running:
            raise
        return _dead_again(inbox, bind, letter, error, names, counted=True)
    return _outcome(letter, taken, names)


def process_requeued(inbox: InboxSettings, bind: Sessions, *, limit: int) -> list[Processed]:
    limit = check_limit(limit)
    with open_session(bind, _WHAT) as session, session.begin():
        letters = read(connection_of(session, _WHAT, DEAD_BIND), inbox.name, limit)
    return [_reported(inbox, letter, _one(inbox, bind, letter)) for letter in letters]


async def _dead_again_async(
    inbox: InboxSettings,
    bind: AsyncSessions,
    letter: Requeued,
    error: BaseException,
    names: tuple[str, ...],
    *,
    counted: bool,
) -> Processed:
    async with open_async_session(bind, _WHAT) as session, session.begin():
        connection = await async_connection_of(session, _WHAT, DEAD_BIND)
        again = await dead_again_async(connection, inbox.name, letter.dead_id, error, counted=counted)
    return _buried(letter, again, names, error)


async def _run_handlers(
    session: AsyncSession, handlers: tuple[InboxHandler, ...], letter: Requeued, stage: Stage
) -> None:
    for handler in handlers:
        stage.handler = handler.name
        if handler.is_async:
            await handler.fn(session, letter.message)
        else:  # on the session's own greenlet, so its SQL runs on this connection
            await session.run_sync(handler.fn, letter.message)
    stage.handler = None
    await session.flush()


async def _one_async(inbox: InboxSettings, bind: AsyncSessions, letter: Requeued) -> Processed:
    handlers = inbox.handlers.matching(letter.message.event_type)
    names = tuple(h.name for h in handlers)
    if not handlers:
        refused = inbox.no_handler(letter.message.event_type)
        return await _dead_again_async(inbox, bind, letter, refused, names, counted=False)
    stage = Stage()
    try:
        async with open_async_session(bind, _WHAT) as session, session.begin():
            connection = await async_connection_of(session, _WHAT, DEAD_BIND)
            taken = await take_async(connection, inbox.name, letter.dead_id)
            if taken:
                stage.running = True
                await _run_handlers(session, handlers, letter, stage)
                stage.running = False
    except Exception as error:
        if not stage.running:
            raise
        return await _dead_again_async(inbox, bind, letter, error, names, counted=True)
    return _outcome(letter, taken, names)


async def process_requeued_async(inbox: InboxSettings, bind: AsyncSessions, *, limit: int) -> list[Processed]:
    limit = check_limit(limit)
    async with open_async_session(bind, _WHAT) as session, session.begin():
        letters = await read_async(await async_connection_of(session, _WHAT, DEAD_BIND), inbox.name, limit)
    return [_reported(inbox, letter, await _one_async(inbox, bind, letter)) for letter in letters]
