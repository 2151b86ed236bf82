"""The FastAPI webhook receiver example, served by uvicorn as a process of its own, for kill tests.

``python webhook_receiver_app.py`` serves ``examples/webhook_receiver_fastapi.py``
as it is written (its ``WebhookReceiver``, its inbox, its ``payments`` table,
which has no unique constraint: a second effect of one webhook would show as a
second row) on 127.0.0.1, behind a wrapper that belongs to this test app only:

- ``WEBHOOK_RECEIVER_KILL_AT``: the process SIGKILLs itself at its N-th
  ``handled`` answer, after the receiver committed that webhook and before
  the answer goes out (the acknowledgement of an HTTP delivery is its
  answer), touching ``kill-<webhook-id>`` in ``WEBHOOK_RECEIVER_DIR`` first;
- every answer saying ``duplicate`` touches ``duplicate-<webhook-id>-<n>``
  there: evidence that a redelivery reached the receiver and changed nothing;
- ``WEBHOOK_RECEIVER_TOGETHER``: a number of receivers; each request then
  touches ``request-<pid>-<webhook-id>`` as it arrives, and an extra handler
  keeps the first receiver's transaction (its marker taken, its payment
  added) open until that many receivers have the request in hand (at most
  ten seconds), touching ``together-<webhook-id>`` if they all came: the
  same webhook is then provably received at once;
- ``WEBHOOK_RECEIVER_PORT`` is the
  port (the same across restarts, so the sender's URL keeps working);
  ``DATABASE_URL`` and ``WEBHOOK_SECRET`` are the example's own settings.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from sqlalchemy.ext.asyncio import AsyncSession

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import webhook_receiver_fastapi as example  # noqa: E402

from outbox import InboxMessage  # noqa: E402

KILL_AT = int(os.environ.get("WEBHOOK_RECEIVER_KILL_AT") or 0)
TOGETHER = int(os.environ.get("WEBHOOK_RECEIVER_TOGETHER") or 0)
DIR = Path(os.environ["WEBHOOK_RECEIVER_DIR"])
handled = itertools.count(1)


if TOGETHER:

    @example.inbox.handler("order.paid", name="wait_for_the_others")
    async def wait_for_the_others(session: AsyncSession, message: InboxMessage) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while loop.time() < end:
            if len(list(DIR.glob(f"request-*-{message.id}"))) >= TOGETHER:
                (DIR / f"together-{message.id}").touch()
                return
            await asyncio.sleep(0.01)


def dying(app: Any) -> Any:
    """The application, with answers that leave evidence and may never go out."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # the lifespan goes through as it is
            await app(scope, receive, send)
            return
        webhook = dict(scope["headers"]).get(b"webhook-id", b"").decode()
        if TOGETHER:
            (DIR / f"request-{os.getpid()}-{webhook}").touch()
        start: dict[str, Any] = {}

        async def answer(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)  # held back until the body says what the answer is
                return
            body = message.get("body", b"")
            if start["status"] == 200 and body.startswith(b"handled") and next(handled) == KILL_AT:
                (DIR / f"kill-{webhook}").touch()
                os.kill(os.getpid(), signal.SIGKILL)  # committed; the sender never hears of it
            if body.startswith(b"duplicate"):
                (DIR / f"duplicate-{webhook}-{uuid.uuid4().hex[:8]}").touch()
            if start:
                await send(dict(start))
                start.clear()
            await send(message)

        await app(scope, receive, answer)

    return wrapped


if __name__ == "__main__":
    application = example.create_app(os.environ["DATABASE_URL"], os.environ["WEBHOOK_SECRET"])
    uvicorn.run(
        dying(application),
        host="127.0.0.1",
        port=int(os.environ["WEBHOOK_RECEIVER_PORT"]),
        lifespan="on",
        log_level="warning",
        access_log=False,
    )
