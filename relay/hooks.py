"""The optional hooks a handler object may define for the relay's start and stop.

``outbox_bind(engine)`` is offered the relay's engine once the database
answers, so a handler that keeps state in the database (the email sent-log)
needs no engine of its own. A handler whose bind fails is not set up as it
expects to be, so any failure there keeps the relay from starting, as one
clear :class:`~outbox.ConfigurationError` naming the route, the hook and what
it raised.

``outbox_start(route, *, longest_retry_gap)``, plain or async, runs once per
route before the relay claims anything. ``longest_retry_gap`` is the longest
time, in seconds, between an attempt the handler completed but the relay never
recorded (it crashed) and that message's next attempt: the lease, the
recoverer's period, the route's largest backoff ceiling and the poll interval.
A handler whose downstream deduplicates within a window (NATS JetStream's
duplicate window) compares the two. Raising :class:`~outbox.ConfigurationError`
keeps the relay from starting; any other failure is logged and the relay starts.

``outbox_shutdown()``, plain or async, lets a handler close what it opened on
the relay's loop (HTTP clients, SMTP connections). A failing shutdown hook is
logged, never raised: one handler cannot keep the relay from stopping, nor the
other handlers from closing.

"Any other failure" includes ``SystemExit``, ``KeyboardInterrupt`` and every
other ``BaseException``, as for handlers' deliveries (``classify.py``): a hook
that raised one would otherwise end the relay in a way no caller expects,
mid-start or mid-stop. The one exception is the relay's own cancellation (a
caller cancelling ``serve()``, the first Ctrl-C under ``asyncio.run``) while
an async hook is awaited: that is raised on, told apart as dispatch tells it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from sqlalchemy.engine import Engine

from outbox import ConfigurationError, Route
from outbox._redact import Redactor

from .classify import describe
from .dispatch import cancelled_by_relay
from .leases import recover_period
from .run_context import log

__all__ = ["bind_handlers", "longest_retry_gap", "shutdown_handlers", "start_handlers"]


def bind_handlers(routes: Iterable[Route], engine: Engine, redactor: Redactor) -> None:
    for route in routes:
        hook = getattr(route.handler, "outbox_bind", None)
        if not callable(hook):
            continue
        try:
            hook(engine)
        except ConfigurationError:
            raise
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: see the module docstring
            name, text = describe(exc, redactor)
            raise ConfigurationError(
                f"route {route.name}: outbox_bind raised {name}: {text}; "
                "the relay cannot start with a handler it could not bind"
            ) from exc


def longest_retry_gap(route: Route, *, lease: float, poll_interval: float) -> float:
    """Seconds from an unrecorded attempt to the message's next attempt, at worst; 0 if none follows.

    Another relay with a longer lease or poll interval may be the one that
    recovers the message: the figure holds for relays configured like this one.
    """
    if route.max_attempts < 2:  # a lapsed lease on the last attempt makes the message dead
        return 0.0
    ceiling = route.backoff.ceiling(route.max_attempts - 1)
    return lease + recover_period(lease) + ceiling + poll_interval


async def start_handlers(
    routes: Iterable[Route], redactor: Redactor, *, lease: float, poll_interval: float
) -> None:
    task = _current_task()
    for route in routes:
        hook = getattr(route.handler, "outbox_start", None)
        if not callable(hook):
            continue
        gap = longest_retry_gap(route, lease=lease, poll_interval=poll_interval)
        cancels_on_entry = task.cancelling()
        try:
            await _awaited(hook(route, longest_retry_gap=gap))
        except ConfigurationError:
            raise
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: see the module docstring
            if cancelled_by_relay(exc, task, cancels_on_entry):
                raise
            _log_failure(
                route, "outbox_start", exc, redactor, action="handler_start", then="; starting anyway"
            )


async def shutdown_handlers(routes: Iterable[Route], redactor: Redactor) -> None:
    task = _current_task()
    for route in routes:
        hook = getattr(route.handler, "outbox_shutdown", None)
        if not callable(hook):
            continue
        cancels_on_entry = task.cancelling()
        try:
            await _awaited(hook())
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: see the module docstring
            if cancelled_by_relay(exc, task, cancels_on_entry):
                raise
            _log_failure(route, "outbox_shutdown", exc, redactor, action="handler_shutdown", then="")


def _current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None, "the hooks run in the relay's serve or drain task"
    return task


async def _awaited(result: Any) -> None:
    """A plain hook's result as it is; an async hook's coroutine (or future) awaited."""
    if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
        await result


def _log_failure(
    route: Route, hook: str, exc: BaseException, redactor: Redactor, *, action: str, then: str
) -> None:
    name, text = describe(exc, redactor)
    log.warning(
        "route %s: %s raised %s: %s%s",
        route.name,
        hook,
        name,
        text,
        then,
        extra={"action": action, "handler": route.name, "hook": hook, "error_type": name},
    )
