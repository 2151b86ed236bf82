"""The overview's figures, read so that the page stays fast on a table of millions.

Everything an operator acts on is read per request: pending, running and
dead messages in one pass (an index scan over a small fraction of the table),
the last hour of history, pauses and relays. Finished messages (delivered, discarded) are most
of a mature table, and counting them means reading all of it, about 0.2 s per
million rows; those counts are refreshed in a background thread at most every
``finished_max_age`` seconds and shown with their age. The first overview after
start waits for them once.
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

__all__ = ["FINISHED", "UNFINISHED", "FinishedCounts", "overview_data"]

FINISHED = ("delivered", "discarded")
UNFINISHED = tuple(s for s in MESSAGE_STATUSES if s not in FINISHED)
CHART_HEIGHT = 120


class FinishedCounts:
    """The finished messages per queue × handler × status, refreshed off the request path."""

    def __init__(self, read: Callable[[], list[ops.QueueHandlerCount]], max_age: float) -> None:
        self._read = read
        self._max_age = max_age
        self._lock = threading.Lock()
        self._value: list[ops.QueueHandlerCount] | None = None
        self._read_at = 0.0
        self._refreshing = False

    def get(self) -> tuple[list[ops.QueueHandlerCount], float]:
        """The counts and their age in seconds; blocks only when there are none yet."""
        with self._lock:
            value, read_at = self._value, self._read_at
            stale = value is not None and time.monotonic() - read_at > self._max_age
            if stale and not self._refreshing:
                self._refreshing = True
                threading.Thread(target=self._refresh, name="outbox-dashboard-counts", daemon=True).start()
        if value is None:
            self._refresh()
            with self._lock:
                value, read_at = self._value, self._read_at
        assert value is not None
        return value, time.monotonic() - read_at

    def _refresh(self) -> None:
        try:
            value = self._read()
        finally:
            with self._lock:
                self._refreshing = False
        with self._lock:
            self._value, self._read_at = value, time.monotonic()


def finished_counts(engine: Engine, max_age: float) -> FinishedCounts:
    return FinishedCounts(lambda: ops.breakdown(engine, statuses=FINISHED), max_age)


@dataclass(frozen=True)
class Bar:
    x: int
    delivered: int
    retried: int
    died: int
    label: str


def _bars(minutes: list[ops.MinuteActivity]) -> tuple[list[Bar], int]:
    peak = max((m.delivered + m.retried + m.died for m in minutes), default=0)
    scale = CHART_HEIGHT / peak if peak else 0.0
    bars = [
        Bar(
            x=i * 10,
            delivered=round(m.delivered * scale),
            retried=round(m.retried * scale),
            died=round(m.died * scale),
            label=f"{m.minute:%H:%M} delivered {m.delivered}, retried {m.retried}, died {m.died}",
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


def overview_data(engine: Engine, finished: FinishedCounts) -> dict[str, Any]:
    """One pass over the unfinished messages, the last hour of history, pauses and relays; no full count."""
    live = ops.breakdown(engine, statuses=UNFINISHED)
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
        "bars": bars,
        "peak": peak,
        "chart_height": CHART_HEIGHT,
        "totals": {
            "delivered": sum(m.delivered for m in activity),
            "retried": sum(m.retried for m in activity),
            "died": sum(m.died for m in activity),
        },
        "relays": ops.relays(engine),
    }
