"""The optional hooks a handler object may define for the relay's start and stop.

``outbox_bind(engine)`` is offered the relay's engine once the database
answers, so a handler that keeps state in the database (the email sent-log)
needs no engine of its own. ``outbox_shutdown()``, plain or async, lets a
handler close what it opened on the relay's loop (HTTP clients, SMTP
connections). A failing shutdown hook is logged, never raised: one handler
cannot keep the relay from stopping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from sqlalchemy.engine import Engine

from outbox import Route
from outbox._redact import Redactor

from .runtime import log

__all__ = ["bind_handlers", "shutdown_handlers"]


def bind_handlers(routes: Iterable[Route], engine: Engine) -> None:
    for route in routes:
        hook = getattr(route.handler, "outbox_bind", None)
        if callable(hook):
            hook(engine)


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
            try:
                reason = str(exc)
            except Exception:
                reason = f"<unprintable {type(exc).__name__}>"
            log.warning(
                "route %s: outbox_shutdown failed: %s",
                route.name,
                redactor.text(reason),
                extra={"action": "handler_shutdown", "handler": route.name},
            )
