"""Where in a queue the next claim starts scanning.

On PostgreSQL an update leaves the row's old entry in the claim index
(``ix_outbox_message_claim``: pending rows in ``(queue, priority, id)``
order) until a vacuum removes it, and a vacuum may remove it only once no
transaction could still see the old version. A claim that scans from the
front of that index steps over the entry of every row claimed since: late in
a drain of a million messages that is thousands of index pages a claim; while
a transaction holds back the xmin horizon (an idle ``BEGIN``, a long
REPEATABLE READ report) it grows with every second of the hold, and the
claim, not the handlers, becomes the bottleneck.

So a claim starts at a position, ``(priority, id)``, and steps over only the
entries of rows claimed since. The position is the first row the last claim
of the queue took; after a claim that took nothing, the end of the queue.

What sorts before the position and is claimable must reach a claim. A relay
that does not listen (``--no-listen``, SQLite, a drain) hears nothing, so it
keeps a position only while a backlog lasts (the last claim came back full)
and claims from the front otherwise. A listening relay keeps its positions
and moves them back on what it hears or does:

* a NOTIFY names the first row a commit inserted into a queue
  (migration ``outbox_0023``): the position moves back to it, so an id taken
  early by a transaction that commits late is claimed at once;
* a NOTIFY without a position (an operator's requeue, retry-now, unpause or
  unpark, a relay's release at shutdown, a trigger older than ``outbox_0023``),
  a lease this relay recovered, and a LISTEN connection that is new or came
  back: every position goes back to the front;
* a retry this relay wrote, when it comes due, and a grouped message it
  finished (the group's next message may now be claimed): back to that row.

What is left is what a claim stepped over without taking: a message whose
``emit(delay=...)`` had not passed, a row another relay's claim held locked
at that instant, a group member whose predecessor another relay finished.
Not listening, a claim from the front takes those. Listening, a look behind
the position finds the first of them (a plain ``SELECT`` of the claim's
conditions, beside the claims, on a connection of its own) and moves the
position back to it: a claim from the front walks every dead entry at the
front of the index, and while it ran, a commit's wake-up would wait for it.
Either runs at least every :data:`FRONT_SCAN_EVERY` seconds (or the relay's
``poll_interval``, if shorter), and while it is costly (a held transaction)
no more than about one percent of the time, at most every
:data:`FRONT_SCAN_MAX` seconds.

Per-group order is kept regardless: a grouped row is claimable only once no
earlier row of its group is unfinished, wherever the scan starts.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from outbox._routes import PRIORITY_RANGE

__all__ = [
    "END",
    "FRONT",
    "FRONT_SCAN_EVERY",
    "FRONT_SCAN_MAX",
    "RELEASED",
    "ClaimPositions",
    "Position",
    "named_position",
    "of_schema",
]

#: The longest a row stepped over waits for a claim from the front, while the front is cheap.
FRONT_SCAN_EVERY: Final = 1.0

#: The longest it waits while a held transaction makes the front costly.
FRONT_SCAN_MAX: Final = 10.0

#: How many times its own duration apart claims from the front run, at least.
_FRONT_SCAN_SPACING: Final = 100.0

#: The position before every row: a claim from the front of its queue.
FRONT: Final = (PRIORITY_RANGE[0], 0)

#: The position after every row: nothing is claimable from here on until something is heard.
END: Final = (PRIORITY_RANGE[1], 2**63 - 1)

#: (priority, id) of the first row a claim may take; None: the front of the queue.
Position = tuple[int, int] | None


class ClaimPositions:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, poll_interval: float = 1.0) -> None:
        self._clock = clock
        #: a relay polling more often than FRONT_SCAN_EVERY claims from the front as often, while cheap
        self._poll_interval = poll_interval
        self._at: dict[str, tuple[int, int]] = {}
        self._front_scanned: dict[str, float] = {}
        self._front_every: dict[str, float] = {}
        #: retries this relay wrote: (when due, queue, position), soonest first
        self._due: list[tuple[float, str, tuple[int, int]]] = []
        self._held = False
        # What a claim in flight cannot have seen: a commit heard, or a rewind, after its snapshot may
        # have been taken. Its result must not move the position past them (see claimed()).
        self._heard_since_start: dict[str, tuple[int, int]] = {}
        self._rewinds = 0
        self._rewinds_at_start: dict[str, int] = {}

    @property
    def held(self) -> bool:
        """Whether positions are kept between claims (the relay listens)."""
        return self._held

    def hold(self, listening: bool) -> None:
        """Keep positions between claims only while listening: a relay that stops hearing forgets them."""
        if self._held and not listening:
            self._at.clear()
            self._due.clear()
        self._held = listening

    def start(self, queue: str) -> Position:
        """Where the next claim of ``queue`` starts.

        Not listening, that is the front whenever the last claim from the
        front is :meth:`front_due`. Listening, the position stays: the rows
        behind it are looked for beside the claims (:meth:`sweep_due`).
        """
        now = self._clock()
        self._heard_since_start.pop(queue, None)
        self._rewinds_at_start[queue] = self._rewinds
        while self._due and self._due[0][0] <= now:
            _, due_queue, due = heapq.heappop(self._due)
            self.lower(due_queue, due)
        position = self._at.get(queue)
        if position is None or (not self._held and self._front_due(queue, now)):
            return None
        return position

    def sweep_due(self, queue: str) -> tuple[int, int] | None:
        """Listening: the position to look behind for rows stepped over, if it is time to; else None."""
        position = self._at.get(queue)
        if not self._held or position is None or not self._front_due(queue, self._clock()):
            return None
        return position

    def swept(self, queue: str, seconds: float) -> None:
        """A look behind the position (or a claim from the front) took ``seconds``: space the next one."""
        self._front_scanned[queue] = self._clock()
        least = min(FRONT_SCAN_EVERY, self._poll_interval)
        most = max(FRONT_SCAN_MAX, least)
        self._front_every[queue] = min(most, max(least, seconds * _FRONT_SCAN_SPACING))

    def _front_due(self, queue: str, now: float) -> bool:
        every = self._front_every.get(queue, 0.0)
        return now - self._front_scanned.get(queue, float("-inf")) >= every

    def claimed(self, queue: str, started: Position, rows: Sequence[Any], limit: int, seconds: float) -> None:
        """Record a claim that started at ``started``, took ``rows`` (sorted) of ``limit``, in ``seconds``.

        Listening, what was heard while the claim ran wins over its result: a
        row whose commit was heard after the claim took its snapshot is not in
        ``rows``, and a claim that found nothing must not then wait at the end
        of the queue with that row behind it.
        """
        if started is None:
            self.swept(queue, seconds)
        if rows and (self._held or len(rows) >= limit):
            first = rows[0]
            self._at[queue] = (first.priority, first.id)
        elif self._held:
            self._at[queue] = END
        else:
            self._at.pop(queue, None)
        if not self._held:
            return
        heard = self._heard_since_start.pop(queue, None)
        if self._rewinds != self._rewinds_at_start.get(queue, self._rewinds):
            self._at.pop(queue, None)
        elif heard is not None and heard < self._at[queue]:
            self._at[queue] = heard

    def lower(self, queue: str, position: tuple[int, int]) -> None:
        """Something at ``position`` may be claimable now: the next claim of ``queue`` starts there."""
        at = self._at.get(queue)
        if at is not None and position < at:
            self._at[queue] = position
        if self._held:
            heard = self._heard_since_start.get(queue)
            if heard is None or position < heard:
                self._heard_since_start[queue] = position

    def due_at(self, queue: str, position: tuple[int, int], seconds: float) -> None:
        """A row at ``position`` becomes claimable in ``seconds``: move back to it then."""
        if self._held:
            heapq.heappush(self._due, (self._clock() + seconds, queue, position))

    def rewind(self) -> None:
        """Anything anywhere may be claimable: every queue's next claim starts at the front."""
        self._at.clear()
        self._rewinds += 1


# -- what a NOTIFY names ------------------------------------------------------------------------

#: The word a relay's NOTIFY after handing back claims ends with: ``'<schema> released'``, or
#: ``'released'`` alone from relays before the schema was named. It names no position.
RELEASED: Final = "released"


def of_schema(payload: str, ours: str | None) -> str | None:
    """What follows the schema in a payload of schema ``ours`` ('' if nothing); None: another schema's.

    Outboxes in several schemas of one database share the channel; another's
    rows are not this relay's to claim, and its operator actions are not a
    reason to claim from the front. ``ours`` None (not looked up yet): every
    payload is taken as this schema's.
    """
    if ours is None:
        return payload.partition(" ")[2]
    if payload in (ours, RELEASED):
        return ""
    if payload.startswith(f"{ours} "):  # a schema's name may hold spaces: never split it
        return payload[len(ours) + 1 :]
    return None


def named_position(rest: str) -> tuple[str, tuple[int, int]] | None:
    """``<priority> <id> <queue>`` (outbox_0023): the queue and its position; None for anything else."""
    parts = rest.split(" ", 2)
    if len(parts) == 3 and parts[0].lstrip("-").isdigit() and parts[1].isdigit():
        return parts[2], (int(parts[0]), int(parts[1]))
    return None
