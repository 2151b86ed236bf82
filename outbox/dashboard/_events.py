"""``/events``: the change feed as server-sent events, one stream per open page.

Each page asks ``auth`` for ``read`` first, like every other page, then gets
an ``update`` event whenever the app's one :class:`~._live.ChangeFeed` sees a
change, and a comment line when nothing happens for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ._pages import allowed_to_read
from ._settings import settings_of

__all__ = ["events"]

#: Comment lines that keep proxies from closing a quiet stream.
KEEPALIVE = 15.0


async def events(request: Request) -> Response:
    """``text/event-stream``: an ``update`` event after every change; the page re-reads its live parts."""
    refusal = await allowed_to_read(request)
    if refusal is not None:
        return refusal
    feed = settings_of(request).feed

    async def stream() -> AsyncIterator[str]:
        yield "retry: 3000\n\n"
        changes = feed.subscribe().__aiter__()
        pending: asyncio.Task[int] | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(changes.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE)
                if not done:
                    yield ": keepalive\n\n"
                    continue
                version = pending.result()
                pending = None
                yield f"event: update\ndata: {version}\n\n"
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending
            await changes.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"cache-control": "no-store", "x-accel-buffering": "no"},
    )
