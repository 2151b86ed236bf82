"""One attempt: call the route's handler under its timeout and classify what happened.

Knows nothing of SQL; it turns a claimed row into a :class:`~outbox.Message`,
runs the handler, and returns a :class:`~outbox.relay.outcomes.Completion` that the
outcome writer writes back. A row whose payload or headers could not be decoded
(``documents.py``) gets its dead outcome here too, without a handler call,
and so does a row claimed past its ``expires_at`` its ``expired`` one.
It also says what an exception was (:func:`describe`) and whether a
cancellation was the relay's own (:func:`cancelled_by_relay`), for the
handlers' start and stop hooks (``hooks.py``) as for their deliveries.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import math
import random
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor
from datetime import UTC, timedelta
from typing import Any

from outbox import Message, PermanentError, RetryLater, Route
from outbox._redact import Redactor

from .clock import utcnow
from .deadline import Deadline
from .documents import Undecodable
from .outcomes import Completion

__all__ = [
    "attempt",
    "cancelled_by_relay",
    "describe",
    "expired",
    "expired_outcome",
    "is_async_handler",
    "to_message",
    "undecodable_outcome",
]

_ERROR_LIMIT = 2000
_NAME_LIMIT = 255  # outbox_attempt.error_type is a VARCHAR(255)
#: The longest retry a handler may ask for: ``RetryLater(delay=float("inf"))`` (or a hostile
#: ``Retry-After``) would otherwise overflow the timestamp arithmetic when the outcome is written.
MAX_RETRY_DELAY = 365 * 24 * 3600.0


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


async def _invoke(handler: Any, message: Message, executor: Executor, *, is_async: bool) -> Any:
    if is_async:
        return await handler(message)
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    call = functools.partial(context.run, _call_plain, handler, message)
    result = await loop.run_in_executor(executor, call)
    if inspect.isawaitable(result):
        result = await result
    return result


def _call_plain(handler: Any, message: Message) -> Any:
    """A plain handler's call, on its thread; what it raises travels back to the loop in a future.

    An asyncio future refuses ``StopIteration``, so the attempt would never hear
    of it and would wait out the route's timeout. It becomes a ``RuntimeError``,
    as PEP 479 makes it in a coroutine: a plain and an async handler raising it
    are recorded alike.
    """
    try:
        return handler(message)
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


def describe(exc: BaseException, redactor: Redactor) -> tuple[str, str]:
    """The exception's public type name (``SystemExit``, ``outbox.RetryLater``) and its redacted text."""
    kind = type(exc)
    # The public path (outbox.RetryLater), not the private module it lives in.
    module = "outbox" if kind.__module__.startswith("outbox._") else kind.__module__
    name = kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
    text = redactor.text(_text_of(exc))
    if len(text) > _ERROR_LIMIT:
        text = text[: _ERROR_LIMIT - 1] + "…"
    return name, text


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

    Whatever the handler raises is classified, even an exception whose own
    ``__str__`` or ``__repr__`` raises (recorded as ``<unprintable Name>``).
    That includes ``SystemExit``, ``KeyboardInterrupt`` and any other
    ``BaseException``: raised by a handler, they fail this attempt (retried, or
    dead on the last one) and the relay carries on, since letting one escape
    would end the event loop and strand every other delivery in flight. A real
    SIGINT or SIGTERM does not arrive this way: the relay's signal handlers
    (``run(install_signal_handlers=True)``), or ``asyncio.run`` for a first
    Ctrl-C, make it a stop request, which cancels the task (below).

    A ``CancelledError`` is the relay's only when the relay cancelled this
    task: its shared deadline (``timed_out``: the route's timeout) or a forced
    stop (the task's cancel count rose while the handler ran; raised on, so the
    claimer records the cut-off). One the handler raised of its own accord (a
    library's inner task, a cancelled future) is an ordinary failure.
    """
    message = to_message(row)
    started = utcnow()
    clock = time.monotonic()
    outcome, status = "delivered", "delivered"
    retry_in: float | None = None  # None: the route's backoff decides; RetryLater(delay=0) means now
    error_type: str | None = None
    error: str | None = None
    detail: dict[str, Any] | None = None
    last = message.attempt >= row.max_attempts
    refund = False
    parked_on: str | None = None
    # The claim's shared timer (relay/deadline.py), not a timer and a task per delivery.
    task = asyncio.current_task()
    assert task is not None
    returned: Any = None
    timed_out = False
    cancels_on_entry = task.cancelling()
    deadline.enter(task)
    try:
        try:
            returned = await _invoke(route.handler, message, executor, is_async=is_async)
        finally:
            timed_out = deadline.leave(task)
    except (asyncio.CancelledError, TimeoutError) as exc:
        if timed_out:
            outcome = "timeout"
            error_type = "TimeoutError"
            error = f"handler did not finish within {route.timeout:g}s"
        elif cancelled_by_relay(exc, task, cancels_on_entry):
            raise  # a forced stop, not the route's limit
        else:
            # The handler's own TimeoutError (a socket, say) or CancelledError: a plain failure.
            outcome = "failed"
            error_type, error = describe(exc, redactor)
            detail = _detail_of(exc, redactor)
    except RetryLater as exc:
        outcome = "retry"
        error_type, error = describe(exc, redactor)
        if exc.delay is not None:
            retry_in = exc.delay
        detail = _detail_of(exc, redactor)
        if not exc.counts_as_attempt:
            refund, last = True, False
            detail = {**(detail or {}), "counted": False}
        if exc.until_recovered is not None:
            parked_on = exc.until_recovered
            detail = {**(detail or {}), "parked_on": parked_on}
    except PermanentError as exc:
        outcome = "dead"
        error_type, error = describe(exc, redactor)
        detail = _detail_of(exc, redactor)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: see the docstring
        outcome = "failed"
        error_type, error = describe(exc, redactor)
        detail = _detail_of(exc, redactor)
    if outcome == "delivered":
        # A handler may return facts about the delivery (HTTP status, SMTP queue id).
        if isinstance(returned, Mapping):
            detail = _redacted(returned, redactor)
    elif outcome == "dead" or last:
        status = "dead"
        if outcome != "dead":
            detail = {**(detail or {}), "exhausted": True, "last_outcome": outcome}
            outcome = "dead"
    else:
        status = "pending"
        if retry_in is None:
            retry_in = route.backoff.delay(message.attempt, rng)
    # Wall-clock stamps place the attempt in time; the monotonic clock measures it.
    finished = started + timedelta(seconds=time.monotonic() - clock)
    # Outcomes are written in batches: one that the database refuses would hold back every
    # other outcome in its batch, so whatever a handler produced is made storable here.
    return message, Completion(
        message_id=message.id,
        attempt=message.attempt,
        outcome=outcome,
        status=status,
        started_at=started,
        finished_at=finished,
        # float: RetryLater(delay=30) gives an int, and one batch's delays travel as one float8 array
        retry_in=float(min(retry_in or 0.0, MAX_RETRY_DELAY)),
        error_type=None if error_type is None else _storable_text(error_type)[:_NAME_LIMIT],
        error=None if error is None else _storable_text(error),
        detail=_storable_detail(detail),
        refund=refund,
        parked_on=None if status != "pending" else parked_on,
    )


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


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, which is the exception's own code and may itself raise.

    Here and in the helpers below, the relay runs the handler's code (an
    exception's ``__str__``, a returned mapping's items), so whatever that
    raises, ``SystemExit`` included, is caught: it must not escape the attempt.
    """
    try:
        text = str(exc)
    except BaseException:
        return f"<unprintable {type(exc).__name__}>"
    return text or type(exc).__name__


def _safe_repr(value: object) -> str:
    try:
        return repr(value)[:_ERROR_LIMIT]
    except BaseException:
        return f"<unprintable {type(value).__name__}>"


def _redacted(data: Mapping[Any, Any], redactor: Redactor) -> dict[str, Any]:
    """A handler's mapping with secrets masked; one whose keys cannot even be printed is kept as a note."""
    try:
        return redactor.mapping(data)
    except BaseException:
        return {"unstorable_detail": _safe_repr(data)}


def _storable_text(text: str) -> str:
    # PostgreSQL text and JSON cannot hold NUL; an exception quoting a binary reply often does.
    return text.replace("\x00", "\\x00")


def _storable_detail(detail: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Plain JSON for the history's detail column.

    Datetimes, UUIDs and Decimals become strings; so do NaN and infinities,
    which PostgreSQL's JSON types reject. A mapping that cannot be serialised
    at all (a cycle, non-string keys) is stored as its repr.
    """
    if detail is None:
        return None
    if _is_plain(detail):  # what handlers usually return (status codes, ids): no round trip needed
        return _without_nul(detail)  # type: ignore[no-any-return]
    try:
        plain = json.loads(json.dumps(detail, default=str), parse_constant=str)
    except BaseException:
        plain = {"unstorable_detail": _safe_repr(detail)}
    cleaned: dict[str, Any] = _without_nul(plain)
    return cleaned


_SCALARS = (str, int, bool, type(None))


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Already plain JSON: exact built-in types, string keys, finite floats, shallow nesting."""
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is float:
        return math.isfinite(value)
    if depth > 8:
        return False
    if kind is dict:
        return all(type(k) is str and _is_plain(v, depth + 1) for k, v in value.items())
    if kind is list:
        return all(_is_plain(v, depth + 1) for v in value)
    return False


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return _storable_text(value)
    if isinstance(value, dict):
        return {_storable_text(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _detail_of(exc: BaseException, redactor: Redactor) -> dict[str, Any] | None:
    """Handlers attach structured facts (HTTP status, SMTP code) as ``exc.detail``."""
    try:
        detail = getattr(exc, "detail", None)
    except BaseException:  # a property of the handler's own exception class
        return None
    if isinstance(detail, dict):
        return _redacted(detail, redactor)
    return None


def secrets_of(handlers: Iterable[Any]) -> list[str]:
    """Secret strings a handler declares (``outbox_secrets()``), to scrub from errors and logs."""
    found: list[str] = []
    for handler in handlers:
        provider = getattr(handler, "outbox_secrets", None)
        if callable(provider):
            found.extend(s for s in provider() if isinstance(s, str) and s)
    return found
