"""Where in a queue the next claim starts scanning, while a backlog lasts.

On PostgreSQL an update leaves the row's old entry in the claim index
(``ix_outbox_message_claim``: pending rows in ``(queue, priority, id)``
order) until a vacuum removes it. A claim that scans from the front of that
index steps over the entry of every row claimed since the last vacuum:
late in a drain of a million messages that is thousands of index pages a
claim, and the drain slows as it goes. Autovacuum cannot keep up, because it
visits a database at most once per ``autovacuum_naptime``.

So while a queue has a backlog (the last claim came back full), the next
claim starts at the first row the last one took, and steps over only the
entries of rows claimed since. What sorts before that position and is still
claimable (a retry that came due, a transaction that took its id early and
committed late, a row of a higher priority, the next row of a group whose
previous one finished, a recovered lease, a claim another relay released)
is picked up by a claim from the front, which is made:

* whenever the last claim came back short (the backlog above the position
  ran out, or there was none),
* at least every :data:`FRONT_SCAN_EVERY` seconds while a backlog lasts.

A row can therefore wait at most that long behind the position, during a
backlog in which rows behind it wait far longer. Per-group order is kept
regardless: a grouped row is claimable only once no earlier row of its group
is unfinished, wherever the scan starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from outbox._routes import PRIORITY_RANGE

__all__ = ["FRONT", "FRONT_SCAN_EVERY", "ClaimPositions", "Position"]

#: The longest a claimable row can wait behind the position of a queue's claims.
FRONT_SCAN_EVERY: Final = 1.0

#: The position before every row: a claim from the front of its queue.
FRONT: Final = (PRIORITY_RANGE[0], 0)

#: (priority, id) of the first row a claim may take; None: the front of the queue.
Position = tuple[int, int] | None


class ClaimPositions:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at: dict[str, tuple[int, int]] = {}
        self._front_scanned: dict[str, float] = {}

    def start(self, queue: str) -> Position:
        """Where the next claim of ``queue`` starts."""
        position = self._at.get(queue)
        if position is None or self._clock() - self._front_scanned.get(queue, 0.0) >= FRONT_SCAN_EVERY:
            return None
        return position

    def claimed(self, queue: str, started: Position, rows: Sequence[Any], limit: int) -> None:
        """Record a claim that started at ``started`` and took ``rows`` (sorted) of ``limit``."""
        if started is None:
            self._front_scanned[queue] = self._clock()
        if rows and len(rows) >= limit:
            first = rows[0]
            self._at[queue] = (first.priority, first.id)
        else:
            self._at.pop(queue, None)
