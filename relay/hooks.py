"""The optional hooks a handler object may define for the relay's start and stop.

``outbox_bind(engine)`` is offered the relay's engine once the database
answers, so a handler that keeps state in the database (the email sent-log)
needs no engine of its own. ``outbox_shutdown()``, plain or async, lets a
handler close what it opened on the relay's loop (HTTP clients, SMTP
connections). A failing shutdown hook is logged, never raised: one handler
cannot keep the relay from stopping.

``outbox_start(route, *, longest_retry_gap)``, plain or async, runs once per
route before the relay claims anything. ``longest_retry_gap`` is the longest
time, in seconds, between an attempt the handler completed but the relay never
recorded (it crashed) and that message's next attempt: the lease, the
recoverer's period, the route's largest backoff ceiling and the poll interval.
A handler whose downstream deduplicates within a window (NATS JetStream's
duplicate window) compares the two. Raising :class:`~outbox.ConfigurationError`
keeps the relay from starting; any other failure is logged and the relay starts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from sqlalchemy.engine import Engine

from outbox import ConfigurationError, Route
from outbox._redact import Redactor

from .leases import recover_period
from .run_context import log

__all__ = ["bind_handlers", "longest_retry_gap", "shutdown_handlers", "start_handlers"]


def bind_handlers(routes: Iterable[Route], engine: Engine) -> None:
    for route in routes:
        hook = getattr(route.handler, "outbox_bind", None)
        if callable(hook):
            hook(engine)


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
    for route in routes:
        hook = getattr(route.handler, "outbox_start", None)
        if not callable(hook):
            continue
        gap = longest_retry_gap(route, lease=lease, poll_interval=poll_interval)
        try:
            result = hook(route, longest_retry_gap=gap)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except ConfigurationError:
            raise
        except Exception as exc:
            log.warning(
                "route %s: outbox_start failed: %s",
                route.name,
                redactor.text(_reason(exc)),
                extra={"action": "handler_start", "handler": route.name},
            )


def _reason(exc: Exception) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


async def shutdown_handlers(routes: Iterable[Route], redactor: Redactor) -> None:
    for route in routes:
        hook = getattr(route.handler, "outbox_shutdown", None)
        if not callable(hook):
            continue
        try:
            result = hook()
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await result
        except Exception as exc:
            log.warning(
                "route %s: outbox_shutdown failed: %s",
                route.name,
                redactor.text(_reason(exc)),
                extra={"action": "handler_shutdown", "handler": route.name},
            )
