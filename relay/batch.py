"""Batches: the messages one claim took for one route, handed to its handler in one call.

A handler that defines ``outbox_deliver_batch(messages)`` (plain or async,
like a handler itself) is given every message of a claim that is for its
route at once, and returns one outcome per message, in the same order:

- ``None`` or a ``Mapping``: delivered (the mapping is the attempt's detail);
- an exception instance: that message's attempt ended as if a one-message
  call had raised it (``RetryLater``, ``PermanentError``, anything else).

Each element is classified by the same code as a single call's result
(``classify.py``), so a batch changes how many calls are made, never what an
outcome means: history keeps one row per message attempt, and each message
keeps its own attempt count, backoff and lease. A publisher uses this to put
every message on the wire first and then await the broker's confirmations
together, instead of one round trip per message.

The call itself runs under the route's ``timeout``; if it runs out, or the
call raises, every message of the batch gets that outcome. A result that is
not a list of one outcome per message is the handler's bug: every message of
the batch gets a counted ``failed`` attempt saying so. Rows claimed past their
``expires_at``, or whose documents cannot be decoded, never reach the handler
(as on the one-message path) and get their own outcomes at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import ExitStack
from typing import Any

from outbox import Message, Route

from .classify import classify
from .clock import utcnow
from .deadline import Deadline
from .dispatch import (
    CANCELLED,
    call_under,
    cut_off,
    expired,
    expired_outcome,
    is_async_handler,
    to_message,
    undecodable_outcome,
)
from .documents import undecodable
from .outcomes import Completion
from .run_context import RunContext, log

__all__ = ["HOOK", "BatchCall", "batch_routes", "deliver_batch"]

#: The optional handler method that makes a route's deliveries batches.
HOOK = "outbox_deliver_batch"

Add = Callable[[Message, Completion], None]
#: A batch route's method, and whether it is awaited on the loop (else it runs on a handler thread).
BatchCall = tuple[Callable[[list[Message]], Any], bool]


def batch_routes(routes: Mapping[str, Route]) -> dict[str, BatchCall]:
    """The routes whose handler takes batches, with the method to call; asked once per run.

    A subclass that overrides ``__call__`` of a class with ``outbox_deliver_batch``
    (a publisher wrapped to add something to each publish) expects its
    ``__call__`` to run for every message: its route keeps one call per message,
    and a log line (``batch_skipped``) says how to have batches.
    """
    found: dict[str, BatchCall] = {}
    for name, route in routes.items():
        deliver = getattr(route.handler, HOOK, None)
        if not callable(deliver):
            continue
        shadowing = _call_defined_below_the_hook(type(route.handler))
        if shadowing is not None and HOOK not in getattr(route.handler, "__dict__", {}):
            log.info(
                "route %s: %s overrides __call__ but inherits %s; delivering one message per call, "
                "as its __call__ expects (override %s too for batches)",
                name,
                shadowing.__qualname__,
                HOOK,
                HOOK,
                extra={"action": "batch_skipped", "handler": name},
            )
            continue
        found[name] = (deliver, is_async_handler(deliver))
    return found


def _call_defined_below_the_hook(kind: type) -> type | None:
    """The class whose ``__call__`` the handler runs, if it is a subclass of the one defining the hook."""
    mro = kind.__mro__
    calls = next((c for c in mro if "__call__" in c.__dict__), None)
    hook = next((c for c in mro if HOOK in c.__dict__), None)
    if calls is None or hook is None or calls is hook or not issubclass(calls, hook):
        return None
    return calls


async def deliver_batch(
    rt: RunContext,
    route: Route,
    queue: str,
    rows: Sequence[Any],
    *,
    fn: Callable[[list[Message]], Any],
    is_async: bool,
    deadline: Deadline,
    executor: Executor,
    add: Add,
) -> None:
    """Deliver ``rows`` (all of ``route``, claimed together, their attempts begun) with one call of ``fn``.

    Every row's outcome is handed to ``add`` before this returns; a forced
    stop (the task cancelled while the handler runs) records each one's
    cut-off, as the one-message path does.
    """
    calls: list[Any] = []
    for row in rows:
        if expired(row):  # too late for anyone to see it: discarded, with the time it expired
            add(*expired_outcome(row))
            continue
        unusable = undecodable(row)
        if unusable is not None:  # never the handler's to see: dead, with the reason
            add(*undecodable_outcome(row, unusable))
            continue
        calls.append(row)
    if not calls:
        deadline.skip()
        return
    try:
        with ExitStack() as spans:
            traced = [rt.tracing.process(queue, row, batch=len(calls)) for row in calls]
            for span in traced:
                spans.enter_context(span)
            messages = [to_message(row) for row in calls]
            started, clock = utcnow(), time.monotonic()
            # A list of its own: what the handler does to it cannot change which outcome is whose.
            returned, raised, timed_out = await call_under(
                deadline, fn, list(messages), executor=executor, is_async=is_async
            )
            # Every outcome is decided before any is handed on: no await from here to the end.
            outcomes = _classified(
                rt, route, calls, messages, returned, raised, timed_out, started=started, clock=clock
            )
            for span, completion in zip(traced, outcomes, strict=True):
                span.outcome(completion)
    except asyncio.CancelledError:
        for row in calls:
            add(*cut_off(row, "Cancelled", CANCELLED))
        return
    except Exception as exc:  # a relay bug must not leave a started attempt without its outcome
        log.error(
            "batch of %d message(s) for %s could not be classified",
            len(calls),
            route.name,
            exc_info=True,
            extra={"action": "relay_error", "handler": route.name, "count": len(calls)},
        )
        why = f"the relay failed while running this attempt ({type(exc).__name__})"
        for row in calls:
            add(*cut_off(row, "RelayError", why))
        return
    for message, completion in zip(messages, outcomes, strict=True):
        add(message, completion)


def _classified(
    rt: RunContext,
    route: Route,
    rows: list[Any],
    messages: list[Message],
    returned: Any,
    raised: BaseException | None,
    timed_out: bool,
    *,
    started: Any,
    clock: float,
) -> list[Completion]:
    """One Completion per message: what the call raised for all, else each message's own element."""
    if raised is None and not timed_out:
        problem = _shape_problem(returned, len(messages))
        if problem is not None:
            raised = TypeError(problem)
    results: list[Any] = [None] * len(messages) if raised is not None or timed_out else returned
    completions = []
    for row, message, element in zip(rows, messages, results, strict=True):
        if raised is not None or timed_out:
            error: BaseException | None = raised
        elif element is None or isinstance(element, Mapping):
            error = None
        elif isinstance(element, BaseException):
            error = element
        else:
            error = TypeError(
                f"{HOOK} gave {type(element).__name__} as this message's outcome: expected None or a "
                "Mapping (delivered) or an exception instance"
            )
        completions.append(
            classify(
                route,
                message,
                row.max_attempts,
                started=started,
                clock=clock,
                redactor=rt.redactor,
                rng=rt.rng,
                returned=None if error is not None else element,
                raised=error,
                timed_out=timed_out,
            )
        )
    return completions


def _shape_problem(returned: Any, expected: int) -> str | None:
    """Why ``returned`` is not one outcome per message (a handler bug), or None."""
    if not isinstance(returned, list):
        return (
            f"{HOOK} returned {type(returned).__name__}, not a list of one outcome per message; "
            "no message of the batch is known to be delivered"
        )
    if len(returned) != expected:
        return (
            f"{HOOK} returned {len(returned)} outcome(s) for {expected} message(s); it must return "
            "one per message, in order, so no message of the batch is known to be delivered"
        )
    return None
