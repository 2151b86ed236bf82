"""An application for relay subprocess tests: handlers that raise what ends a Python program.

For each of ``SystemExit``, ``KeyboardInterrupt`` and :class:`Fatal` (a
``BaseException`` of its own), a plain function and an ``async def`` handler
raise it on every attempt: routes ``fatal_<kind>_<style>`` (events of the same
name, see :data:`FATAL_ROUTES`), ``MAX_ATTEMPTS`` attempts each.

Two ordinary routes run beside them, ``neighbour`` (a plain function) and
``async_neighbour``: each delivery touches ``started-<message id>`` in the
directory ``FATAL_NEIGHBOUR_DIR`` names, then waits for a file ``go`` there
(at most a minute) and returns, so a test keeps them in flight while the fatal
ones raise.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox import Backoff, Message, Outbox

MAX_ATTEMPTS = 3
NEIGHBOURS = ("neighbour", "async_neighbour")


class Fatal(BaseException):
    """Not an Exception: what a handler's own "stop everything" might look like."""


RAISED: dict[str, type[BaseException]] = {
    "system_exit": SystemExit,
    "keyboard_interrupt": KeyboardInterrupt,
    "custom": Fatal,
}
#: route name -> the exception type its history rows must name
FATAL_ROUTES: dict[str, str] = {
    f"fatal_{kind}_{style}": "fatal_app.Fatal" if raised is Fatal else raised.__name__
    for kind, raised in RAISED.items()
    for style in ("sync", "async")
}

ob = Outbox(default_backoff=Backoff(base=0.05, cap=0.1))


def _plain(raised: type[BaseException]) -> Callable[[Message], None]:
    def handler(msg: Message) -> None:
        raise raised(f"message {msg.id} ends the program")

    return handler


def _async(raised: type[BaseException]) -> Callable[[Message], Any]:
    async def handler(msg: Message) -> None:
        await asyncio.sleep(0)
        raise raised(f"message {msg.id} ends the program")

    return handler


for _kind, _raised in RAISED.items():
    ob.route(f"fatal_{_kind}_sync", _plain(_raised), name=f"fatal_{_kind}_sync", max_attempts=MAX_ATTEMPTS)
    ob.route(f"fatal_{_kind}_async", _async(_raised), name=f"fatal_{_kind}_async", max_attempts=MAX_ATTEMPTS)


def _started(msg: Message) -> Path:
    directory = Path(os.environ["FATAL_NEIGHBOUR_DIR"])
    (directory / f"started-{msg.id}").touch()
    return directory / "go"


@ob.handler("neighbour", name="neighbour")
def neighbour(msg: Message) -> None:
    go = _started(msg)
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


@ob.handler("async_neighbour", name="async_neighbour")
async def async_neighbour(msg: Message) -> None:
    go = _started(msg)
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
