"""The overview's figures, read so that the page stays fast on a table of millions.

Pending, running and dead messages are counted in one pass (an index scan
over a small fraction of the table) at most once a second however many pages
are open, and again as soon as the live feed sees a change. The last hour of
history, pauses, circuit breakers and relays are read per request. Finished messages
(delivered, discarded) are most of a mature table, and counting them means
reading all of it, about 0.2 s per million rows; those counts are refreshed
in a background thread at most every ``finished_max_age`` seconds and shown
with their age. The first overview after start waits for both once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Engine

from .. import ops
from .._tables import MESSAGE_STATUSES

__all__ = ["FINISHED", "UNFINISHED", "Cached", "finished_counts", "overview_data", "unfinished_counts"]

FINISHED = ("delivered", "discarded")
UNFINISHED = tuple(s for s in MESSAGE_STATUSES if s not in FINISHED)
CHART_HEIGHT = 120
#: The overview's cards: what an operator must act on leads, the rest follow in lifecycle order.
CARD_STATUSES = ("dead", *(s for s in MESSAGE_STATUSES if s != "dead"))


class Cached:
    """One read shared by every page: what N open pages cost the database is one reader's load.

    ``get`` returns the value read at most ``max_age`` seconds ago, reading it
    when older. With ``in_background`` a stale value is returned at once and
    read again in a thread; only the very first read waits. ``refresh`` reads
    now (the live feed calls it when something changed, before telling the
    pages, so their reload finds fresh figures).
    """

    def __init__(
        self, read: Callable[[], list[ops.QueueHandlerCount]], max_age: float, *, in_background: bool
    ) -> None:
        self._read = read
        self._max_age = max_age
        self._in_background = in_background
        self._lock = threading.Lock()  # guards the fields
        self._reading = threading.Lock()  # one read at a time
        self._value: list[ops.QueueHandlerCount] | None = None
        self._read_at = 0.0
        self._refreshing = False

    def get(self) -> tuple[list[ops.QueueHandlerCount], float]:
        """The value and its age in seconds."""
        with self._lock:
            value, read_at = self._value, self._read_at
            stale = value is None or time.monotonic() - read_at > self._max_age
            background = stale and value is not None and self._in_background
            if background and not self._refreshing:
                self._refreshing = True
                threading.Thread(target=self._background, name="outbox-dashboard-counts", daemon=True).start()
        if stale and not background:
            self.refresh(newer_than=read_at)
            with self._lock:
                value, read_at = self._value, self._read_at
        assert value is not None
        return value, time.monotonic() - read_at

    def refresh(self, newer_than: float | None = None) -> None:
        """Read now; when another reader finished a read after ``newer_than`` meanwhile, take its value."""
        with self._reading:
            if newer_than is not None and self._read_at > newer_than:
                return
            value = self._read()
            with self._lock:
                self._value, self._read_at = value, time.monotonic()

    def _background(self) -> None:
        try:
            self.refresh()
        finally:
            with self._lock:
                self._refreshing = False


def finished_counts(engine: Engine, max_age: float) -> Cached:
    """Delivered and discarded: a full count, so read in the background at most every ``max_age``."""
    return Cached(lambda: ops.breakdown(engine, statuses=FINISHED), max_age, in_background=True)


def unfinished_counts(engine: Engine, max_age: float) -> Cached:
    """Pending, running, dead: at most ``max_age`` old when a page reads them, and fresh after a change."""
    return Cached(lambda: ops.breakdown(engine, statuses=UNFINISHED), max_age, in_background=False)


@dataclass(frozen=True)
class Bar:
    x: int
    delivered: int
    retried: int
    died: int
    expired: int
    label: str


def _bars(minutes: list[ops.MinuteActivity]) -> tuple[list[Bar], int]:
    peak = max((m.delivered + m.retried + m.died + m.expired for m in minutes), default=0)
    scale = CHART_HEIGHT / peak if peak else 0.0
    bars = [
        Bar(
            x=i * 10,
            delivered=round(m.delivered * scale),
            retried=round(m.retried * scale),
            died=round(m.died * scale),
            expired=round(m.expired * scale),
            label=(
                f"{m.minute:%H:%M} delivered {m.delivered}, retried {m.retried}, died {m.died}, "
                f"expired {m.expired}"
            ),
        )
        for i, m in enumerate(minutes)
    ]
    return bars, peak


@dataclass(frozen=True)
class Summary:
    dead: int  # dead and not requeued: waiting for an operator
    dead_requeued: int
    oldest_unfinished_age_s: dict[str, float]  # per queue, pending or running, from created_at
    paused: list[ops.Pause]


def overview_data(engine: Engine, unfinished: Cached, finished: Cached) -> dict[str, Any]:
    """The unfinished and finished counts as cached, the last hour of history, pauses, breakers, relays."""
    live, _ = unfinished.get()
    done, age = finished.get()
    now = datetime.now(UTC)
    queues: dict[str, dict[str, dict[str, int]]] = {}
    by_status: dict[str, int] = {}
    oldest: dict[str, datetime] = {}
    for cell in live + done:
        queues.setdefault(cell.queue, {}).setdefault(cell.handler, {})[cell.status] = cell.count
        by_status[cell.status] = by_status.get(cell.status, 0) + cell.count
        stamp = cell.oldest_created_at
        if cell.status in ("pending", "running") and stamp is not None:
            first = oldest.get(cell.queue)
            oldest[cell.queue] = stamp if first is None else min(first, stamp)
    requeued = sum(c.requeued for c in live if c.status == "dead")
    summary = Summary(
        dead=by_status.get("dead", 0) - requeued,
        dead_requeued=requeued,
        oldest_unfinished_age_s={q: max(0.0, (now - t).total_seconds()) for q, t in oldest.items()},
        paused=ops.paused(engine),
    )
    activity = ops.activity(engine, minutes=60)
    bars, peak = _bars(activity)
    return {
        "stats": summary,
        "by_status": by_status,
        "finished_age": age,
        "queues": {q: dict(sorted(h.items())) for q, h in sorted(queues.items())},
        "statuses": MESSAGE_STATUSES,
        "card_statuses": CARD_STATUSES,
        "bars": bars,
        "peak": peak,
        "chart_height": CHART_HEIGHT,
        "totals": {
            "delivered": sum(m.delivered for m in activity),
            "retried": sum(m.retried for m in activity),
            "died": sum(m.died for m in activity),
            "expired": sum(m.expired for m in activity),
        },
        "breakers": ops.breakers(engine),
        "relays": ops.relays(engine),
    }
