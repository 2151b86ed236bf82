"""One timer for the deliveries a claim starts together on one route.

A claim starts its deliveries at once, and those of one route share its
timeout, so one timer can stand for all of them. Per delivery,
``asyncio.timeout`` cost a timer, two coroutines and a small state machine:
about a tenth of a no-op delivery's relay CPU in a py-spy profile.

The semantics are ``asyncio.timeout``'s. When the timer fires, every delivery
of the group still in its handler is cancelled; the attempt turns that
cancellation into its timeout, unless something else cancelled the task too
(a forced stop), which then wins. A handler that swallows the cancellation and
returns is delivered, as with ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Deadline"]

Task = asyncio.Task[Any]


class Deadline:
    """The shared timeout of ``deliveries`` attempts started now; each one calls ``leave`` or ``skip``."""

    __slots__ = ("_expired", "_handle", "_left", "_running")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, deliveries: int) -> None:
        self._running: dict[Task, int] = {}  # in the handler: task -> its cancelling() count on entry
        self._expired: dict[Task, int] = {}  # cancelled by this deadline, not yet left
        self._left = deliveries
        self._handle: asyncio.TimerHandle | None = loop.call_later(timeout, self._expire)

    def enter(self, task: Task) -> None:
        """``task`` calls its handler now."""
        self._running[task] = task.cancelling()

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
        for task in self._running:
            task.cancel()
        self._expired.update(self._running)
        self._running.clear()
