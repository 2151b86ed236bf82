"""One attempt: call the route's handler under its timeout, and the outcomes no handler call decides.

Knows nothing of SQL; it turns a claimed row into a :class:`~outbox.Message`,
runs the handler, and returns a :class:`~outbox.relay.outcomes.Completion` that the
outcome writer writes back (what the call came to is classified in
``classify.py``). A row whose payload or headers could not be decoded
(``documents.py``) gets its dead outcome here too, without a handler call,
and so does a row claimed past its ``expires_at`` its ``expired`` one, and an
attempt the relay cut off (a forced stop, a relay error) its ``failed`` one.
It also says whether a cancellation was the relay's own
(:func:`cancelled_by_relay`), for the handlers' start and stop hooks
(``hooks.py``) as for their deliveries.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import random
import time
from collections.abc import Iterable
from concurrent.futures import Executor
from datetime import UTC
from typing import Any

from outbox import Message, Route
from outbox._redact import Redactor

from .classify import classify
from .clock import utcnow
from .deadline import Deadline
from .documents import Undecodable
from .outcomes import Completion

__all__ = [
    "CANCELLED",
    "attempt",
    "call_under",
    "cancelled_by_relay",
    "cut_off",
    "expired",
    "expired_outcome",
    "is_async_handler",
    "to_message",
    "undecodable_outcome",
]


def to_message(row: Any) -> Message:
    """The handler's view of a claimed row; an undecodable document (``documents.py``) is its reason text."""
    headers = row.headers
    return Message(
        id=row.id,
        event_id=row.event_id,
        event_type=row.event_type,
        handler=row.handler,
        payload=row.payload,
        headers=dict(headers) if headers and type(headers) is not Undecodable else {},
        key=row.idempotency_key,
        group_key=row.group_key,
        attempt=row.attempts,
        aggregate_type=row.aggregate_type,
        aggregate_id=row.aggregate_id,
        created_at=row.created_at,
        expires_at=row.expires_at,
    )


def expired(row: Any) -> bool:
    """Whether a claimed row was past its ``expires_at`` when it was claimed, by the claim's clock.

    On PostgreSQL the claim says so itself (``expired``, by the database's
    ``now()``, which ``outbox_complete`` checks again by its own later clock, so
    the two never disagree); on SQLite ``claimed_at`` is the claim's "now", this
    host's, as every other "now" there.
    """
    flag = getattr(row, "expired", None)  # PostgreSQL: judged by the database in the claim itself
    if flag is not None:
        return bool(flag)
    return row.expires_at is not None and row.expires_at <= row.claimed_at


def is_async_handler(handler: Any) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    call = getattr(handler, "__call__", None)  # noqa: B004 - objects with an async __call__
    return call is not None and inspect.iscoroutinefunction(call)


async def _invoke(fn: Any, argument: Any, executor: Executor, *, is_async: bool) -> Any:
    """``fn(argument)``: awaited on the loop if ``fn`` is async, else on a handler thread."""
    if is_async:
        return await fn(argument)
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    call = functools.partial(context.run, _call_plain, fn, argument)
    result = await loop.run_in_executor(executor, call)
    if inspect.isawaitable(result):
        result = await result
    return result


def _call_plain(fn: Any, argument: Any) -> Any:
    """A plain handler's call, on its thread; what it raises travels back to the loop in a future.

    An asyncio future refuses ``StopIteration``, so the attempt would never hear
    of it and would wait out the route's timeout. It becomes a ``RuntimeError``,
    as PEP 479 makes it in a coroutine: a plain and an async handler raising it
    are recorded alike.
    """
    try:
        return fn(argument)
    except StopIteration as exc:
        raise RuntimeError("handler raised StopIteration") from exc


def cancelled_by_relay(exc: BaseException, task: asyncio.Task[Any], cancels_on_entry: int) -> bool:
    """Whether ``exc`` is the relay cancelling ``task``, not a ``CancelledError`` of the awaited code's own.

    Every ``Task.cancel()`` (a forced stop, a caller cancelling ``serve()``,
    ``asyncio.run``'s first Ctrl-C) raises the task's ``cancelling()`` count,
    and the deadline undoes its own cancel before the attempt looks. A
    ``CancelledError`` that arrives with the count where it was when the call
    began was raised by the called code itself (a library's cancelled future, a
    closed client's pending call): an ordinary failure of that code.
    """
    return isinstance(exc, asyncio.CancelledError) and task.cancelling() > cancels_on_entry


async def attempt(
    route: Route,
    row: Any,
    *,
    executor: Executor,
    redactor: Redactor,
    rng: random.Random,
    is_async: bool,
    deadline: Deadline,
) -> tuple[Message, Completion]:
    """Run one delivery attempt; never raises except on cancellation of the relay itself.

    Whatever the handler raises is classified (``classify.py``), even an
    exception whose own ``__str__`` or ``__repr__`` raises (recorded as
    ``<unprintable Name>``). That includes ``SystemExit``,
    ``KeyboardInterrupt`` and any other ``BaseException``: raised by a
    handler, they fail this attempt (retried, or dead on the last one) and the
    relay carries on, since letting one escape would end the event loop and
    strand every other delivery in flight. A real SIGINT or SIGTERM does not
    arrive this way: the relay's signal handlers
    (``run(install_signal_handlers=True)``), or ``asyncio.run`` for a first
    Ctrl-C, make it a stop request, which cancels the task (below).
    """
    message = to_message(row)
    started = utcnow()
    clock = time.monotonic()
    returned, raised, timed_out = await call_under(
        deadline, route.handler, message, executor=executor, is_async=is_async
    )
    return message, classify(
        route,
        message,
        row.max_attempts,
        started=started,
        clock=clock,
        redactor=redactor,
        rng=rng,
        returned=returned,
        raised=raised,
        timed_out=timed_out,
    )


async def call_under(
    deadline: Deadline, fn: Any, argument: Any, *, executor: Executor, is_async: bool
) -> tuple[Any, BaseException | None, bool]:
    """``fn(argument)`` under the route's ``deadline``: (what it returned, what it raised, timed out).

    A ``CancelledError`` is the relay's only when the relay cancelled this
    task: its shared deadline (timed out: the route's timeout) or a forced
    stop (the task's cancel count rose while the call ran; raised on, so the
    claimer records the cut-off). One the called code raised of its own
    accord (a library's inner task, a cancelled future) is returned as an
    ordinary failure, as is its own ``TimeoutError`` (a socket's, say).
    """
    # The claim's shared timer (relay/deadline.py), not a timer and a task per delivery.
    task = asyncio.current_task()
    assert task is not None
    timed_out = False
    cancels_on_entry = task.cancelling()
    deadline.enter(task)
    try:
        try:
            return await _invoke(fn, argument, executor, is_async=is_async), None, False
        finally:
            timed_out = deadline.leave(task)
    except (asyncio.CancelledError, TimeoutError) as exc:
        if timed_out:
            return None, exc, True
        if cancelled_by_relay(exc, task, cancels_on_entry):
            raise  # a forced stop, not the route's limit
        return None, exc, False
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: see attempt()
        return None, exc, False


def undecodable_outcome(row: Any, reason: str) -> tuple[Message, Completion]:
    """The outcome of a row whose payload or headers cannot be decoded: dead, its handler never called.

    No attempt could ever do better, so the message is not retried; the claim
    counted the attempt, and the history row says why it went dead.
    """
    now = utcnow()
    return to_message(row), Completion(
        message_id=row.id,
        attempt=row.attempts,
        outcome="dead",
        status="dead",
        started_at=now,
        finished_at=now,
        error_type="UndecodableMessage",
        error=reason,
    )


def expired_outcome(row: Any) -> tuple[Message, Completion]:
    """The outcome of a row claimed past its ``expires_at``: discarded, its handler never called.

    Too late is too late on every later attempt as well, so the message is
    not retried. The claim counted the attempt; the history row says when the
    message expired and that no handler saw it.
    """
    now = utcnow()
    when = row.expires_at.astimezone(UTC)
    return to_message(row), Completion(
        message_id=row.id,
        attempt=row.attempts,
        outcome="expired",
        status="discarded",
        started_at=now,
        finished_at=now,
        error_type="Expired",
        # Short enough for a table cell (outbox show); the detail keeps the exact time.
        error=f"not handed to the handler: expired at {when:%Y-%m-%dT%H:%M:%SZ}",
        detail={"expires_at": when.isoformat()},
    )


CANCELLED = "the relay stopped before the handler finished; it may or may not have taken effect"


def cut_off(row: Any, error_type: str, error: str) -> tuple[Message, Completion]:
    """An attempt that began but never finished normally (a forced stop, a relay error).

    It counts, like any attempt that may have taken effect; on its last attempt
    the message goes dead, as a lease recovery would make it.
    """
    now = utcnow()
    last = row.attempts >= row.max_attempts
    return to_message(row), Completion(
        message_id=row.id,
        attempt=row.attempts,
        outcome="dead" if last else "failed",
        status="dead" if last else "pending",
        started_at=now,
        finished_at=now,
        error_type=error_type,
        error=error,
        detail={"exhausted": True, "last_outcome": "failed"} if last else None,
    )


def secrets_of(handlers: Iterable[Any]) -> list[str]:
    """Secret strings a handler declares (``outbox_secrets()``), to scrub from errors and logs."""
    found: list[str] = []
    for handler in handlers:
        provider = getattr(handler, "outbox_secrets", None)
        if callable(provider):
            found.extend(s for s in provider() if isinstance(s, str) and s)
    return found
