"""One timer at a time for the deliveries a claim starts on one route.

Per delivery, ``asyncio.timeout`` cost a timer, two coroutines and a small
state machine: about a tenth of a no-op delivery's relay CPU in a py-spy
profile. The deliveries a claim starts on one route share the route's timeout
and begin within moments of each other, so their deadlines come in the order
they began: one timer, set for the earliest deadline still running, stands for
all of them, and is set again for the next when it fires. Each delivery keeps
its own full window, counted from the moment its handler is called.

The semantics are ``asyncio.timeout``'s. A delivery whose window has passed is
cancelled; the attempt turns that cancellation into its timeout, unless
something else cancelled the task too (a forced stop), which then wins. A
handler that swallows the cancellation and returns is delivered.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Deadline"]

Task = asyncio.Task[Any]


class Deadline:
    """The shared timeout of ``deliveries`` attempts: each calls ``enter`` then ``leave``, or ``skip``."""

    __slots__ = ("_expired", "_handle", "_left", "_loop", "_running", "_timeout")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, deliveries: int) -> None:
        self._loop = loop
        self._timeout = timeout
        # In the handler, in the order they entered (so by deadline): task -> (its deadline,
        # its cancelling() count on entry).
        self._running: dict[Task, tuple[float, int]] = {}
        self._expired: dict[Task, int] = {}  # cancelled by this deadline, not yet left
        self._handle: asyncio.TimerHandle | None = None
        self._left = deliveries

    def enter(self, task: Task) -> None:
        """``task`` calls its handler now: its window starts."""
        due = self._loop.time() + self._timeout
        self._running[task] = (due, task.cancelling())
        if self._handle is None:
            self._handle = self._loop.call_at(due, self._expire)

    def leave(self, task: Task) -> bool:
        """``task``'s handler returned or raised: True if this deadline, and nothing else, cut it off."""
        self._one_less()
        if self._running.pop(task, None) is not None:
            return False
        before = self._expired.pop(task, None)
        # Undo this deadline's cancel; a count still above the one on entry is someone else's.
        return before is not None and task.uncancel() <= before

    def skip(self) -> None:
        """A delivery of the group that never called its handler (the relay was stopping)."""
        self._one_less()

    def _one_less(self) -> None:
        self._left -= 1
        if self._left == 0 and self._handle is not None:
            self._handle.cancel()  # everyone is done: no timer left behind in the loop
            self._handle = None

    def _expire(self) -> None:
        self._handle = None
        now = self._loop.time()
        for task, (due, before) in list(self._running.items()):
            if due > now:  # the first still inside its window: the rest entered after it
                self._handle = self._loop.call_at(due, self._expire)
                return
            del self._running[task]
            self._expired[task] = before
            task.cancel()
