"""Which relays are alive: ``outbox_relay_registry``, as each relay last wrote it.

Relays keep their state in memory; the registry row is the one place an
operator, or a dashboard, can see all of them at once without scraping each
relay's metrics. A relay rewrites its row every :data:`REGISTRY_PERIOD`
seconds, so a row not rewritten for :data:`MISSED_PERIODS` periods belongs to
a relay that crashed, hung or lost its database; one late write is not enough
to call it dead.

"Now" is taken from the clock the relays stamp ``seen_at`` with: the server's
``now()`` on PostgreSQL (as the relay's store does), this host's UTC clock on
SQLite, where relay and reader share a machine. An operator's laptop with a
skewed clock therefore cannot make live relays look dead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection, Engine

from .._tables import outbox_relay_registry
from ._base import OpsError, _now

__all__ = ["MISSED_PERIODS", "REGISTRY_PERIOD", "HandlerSeen", "RelaySeen", "relays"]

#: Seconds between a relay's registry writes, unless the relay is told otherwise.
REGISTRY_PERIOD = 5.0
#: Periods without a write after which a relay that did not say it stopped is taken for dead.
MISSED_PERIODS = 3

r = outbox_relay_registry


@dataclass(frozen=True, slots=True)
class HandlerSeen:
    """One route of a relay as it last reported it: open breakers are destinations it holds back."""

    breakers: dict[str, bool]  # {destination: is_open}; empty for handlers without breakers
    rate_limit: float | None  # deliveries per second (per destination for webhooks); None: no limit

    def as_dict(self) -> dict[str, Any]:
        return {"breakers": dict(self.breakers), "rate_limit": self.rate_limit}

    @property
    def open_breakers(self) -> list[str]:
        return sorted(d for d, is_open in self.breakers.items() if is_open)


@dataclass(frozen=True, slots=True)
class RelaySeen:
    """One ``outbox_relay_registry`` row, and whether that relay is alive now."""

    relay_id: str
    host: str
    pid: int
    started_at: datetime
    seen_at: datetime  # its last write: start, every period, and its clean stop
    stopped_at: datetime | None  # set by a clean stop, cleared when a relay with this id starts again
    queues: tuple[str, ...] | None  # None: every queue
    in_flight: int
    handlers: dict[str, HandlerSeen]
    alive: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "relay_id": self.relay_id,
            "host": self.host,
            "pid": self.pid,
            "started_at": self.started_at.isoformat(),
            "seen_at": self.seen_at.isoformat(),
            "stopped_at": None if self.stopped_at is None else self.stopped_at.isoformat(),
            "queues": None if self.queues is None else list(self.queues),
            "in_flight": self.in_flight,
            "handlers": {name: h.as_dict() for name, h in self.handlers.items()},
            "alive": self.alive,
        }


def _handlers(stored: Any) -> dict[str, HandlerSeen]:
    """Tolerant of rows written by other versions: a missing or odd field reads as "nothing known"."""
    found: dict[str, HandlerSeen] = {}
    if not isinstance(stored, Mapping):
        return found
    for name, state in stored.items():
        state = state if isinstance(state, Mapping) else {}
        breakers = state.get("breakers")
        rate = state.get("rate_limit")
        found[str(name)] = HandlerSeen(
            breakers={str(k): bool(v) for k, v in breakers.items()} if isinstance(breakers, Mapping) else {},
            rate_limit=float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None,
        )
    return found


def _clock(conn: Connection) -> datetime:
    if conn.dialect.name == "postgresql":
        now: datetime = conn.execute(select(func.now())).scalar_one()
        return now
    return _now()


def relays(engine: Engine, *, period: float = REGISTRY_PERIOD) -> list[RelaySeen]:
    """Every relay that ever wrote its row, the most recently seen first.

    ``period`` is the relays' registry interval (``Relay(registry_interval=...)``):
    give the one they run with if it is not the default, or live relays with a
    longer one look dead.
    """
    number = isinstance(period, int | float) and not isinstance(period, bool)
    if not number or not math.isfinite(period) or period <= 0:
        raise OpsError(f"period must be a number of seconds > 0, got {period!r}")
    with engine.connect() as conn:
        now = _clock(conn)
        rows = conn.execute(select(r).order_by(r.c.seen_at.desc(), r.c.relay_id)).all()
    fresh_after = now - timedelta(seconds=period * MISSED_PERIODS)
    return [
        RelaySeen(
            relay_id=row.relay_id,
            host=row.host,
            pid=row.pid,
            started_at=row.started_at,
            seen_at=row.seen_at,
            stopped_at=row.stopped_at,
            queues=tuple(str(q) for q in row.queues) if isinstance(row.queues, list) and row.queues else None,
            in_flight=row.in_flight,
            handlers=_handlers(row.handlers),
            alive=row.stopped_at is None and row.seen_at >= fresh_after,
        )
        for row in rows
    ]
