"""An application for relay subprocess tests: one route whose handler's start and stop hooks raise.

``HOOK_RAISES`` (in the relay's environment) says which hook raises what, as
``hook=kind`` pairs separated by commas: hooks ``bind``, ``start`` and
``shutdown``; kinds ``system_exit``, ``keyboard_interrupt`` and ``custom``
(:class:`Fatal`, a ``BaseException`` of its own). ``start=system_exit,shutdown=custom``
makes ``outbox_start`` call ``sys.exit`` and ``outbox_shutdown`` raise ``Fatal``.
The handler itself delivers every message.
"""

from __future__ import annotations

import os
import sys

from sqlalchemy.engine import Engine

from outbox import Message, Outbox, Route

EVENT = "hooked.event"


class Fatal(BaseException):
    """Not an Exception: what a library's own "stop everything" might look like."""


def _raise(kind: str, hook: str) -> None:
    if kind == "system_exit":
        sys.exit(f"{hook} gives up")
    if kind == "keyboard_interrupt":
        raise KeyboardInterrupt(f"{hook} interrupted")
    raise Fatal(f"{hook} ends everything")


def _kind(hook: str) -> str | None:
    pairs = dict(p.split("=", 1) for p in os.environ.get("HOOK_RAISES", "").split(",") if p)
    return pairs.get(hook)


class Hooked:
    def __call__(self, msg: Message) -> None:
        pass

    def outbox_bind(self, engine: Engine) -> None:
        if kind := _kind("bind"):
            _raise(kind, "outbox_bind")

    async def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
        if kind := _kind("start"):
            _raise(kind, "outbox_start")

    async def outbox_shutdown(self) -> None:
        if kind := _kind("shutdown"):
            _raise(kind, "outbox_shutdown")


ob = Outbox()
ob.route(EVENT, Hooked(), name="hooked")
