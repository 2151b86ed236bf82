"""Checking a mode's result before any figure is reported, and the small statistics it needs.

A mode that cannot verify its result raises :class:`Unverified`; ``python -m
bench`` then reports its figures as null and exits 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import case, create_engine, func, select
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import NullPool

from outbox import outbox_attempt, outbox_message

__all__ = [
    "Expected",
    "Unverified",
    "check_delivered",
    "drain_window",
    "percentile",
    "read_calls",
    "read_handler_starts",
    "read_traces",
]


class Unverified(Exception):
    """A mode's result did not check out: no figure is reported for it."""


def _engine(url: URL) -> Engine:
    return create_engine(url, poolclass=NullPool)


@dataclass(slots=True)
class Expected:
    """What a drained table must hold: every message delivered once, one history row per attempt."""

    messages: int
    #: messages whose payload says ``fail``: a failed first attempt, then delivered
    failing: int = 0
    relays: Sequence[str] = ()


def check_delivered(url: URL, expected: Expected) -> dict[str, Any]:
    """Check every message and its history; return facts the report may use (history rows, per relay)."""
    m = outbox_message
    a = outbox_attempt
    per_message = (
        select(
            a.c.message_id,
            func.count().label("rows"),
            func.sum(case((a.c.outcome == "delivered", 1), else_=0)).label("delivered"),
            func.sum(case(((a.c.outcome == "failed") & (a.c.attempt == 1), 1), else_=0)).label("failed"),
            func.max(a.c.attempt).label("last"),
        )
        .group_by(a.c.message_id)
        .subquery()
    )
    stmt = select(
        m.c.id,
        m.c.payload,
        m.c.status,
        m.c.attempts,
        per_message.c.rows,
        per_message.c.delivered,
        per_message.c.failed,
        per_message.c.last,
    ).outerjoin(per_message, per_message.c.message_id == m.c.id)
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(stmt).all()
            history_rows = conn.execute(select(func.count()).select_from(a)).scalar_one()
            by_relay: dict[str, int] = {
                relay: n
                for relay, n in conn.execute(select(a.c.relay_id, func.count()).group_by(a.c.relay_id))
            }
            by_outcome: dict[str, int] = {
                outcome: n
                for outcome, n in conn.execute(select(a.c.outcome, func.count()).group_by(a.c.outcome))
            }
    finally:
        engine.dispose()
    if len(rows) != expected.messages:
        raise Unverified(f"expected {expected.messages} messages, found {len(rows)}")
    bad: list[str] = []
    seen: set[int] = set()
    failing = 0
    for row in rows:
        payload = row.payload if isinstance(row.payload, dict) else json.loads(row.payload)
        n = payload["n"]
        seen.add(n)
        fails = bool(payload.get("fail"))
        failing += fails
        attempts = 2 if fails else 1
        ok = (
            row.status == "delivered"
            and row.attempts == attempts
            and row.rows == attempts
            and row.delivered == 1
            and row.failed == attempts - 1
            and row.last == attempts
        )
        if not ok and len(bad) < 5:
            bad.append(
                f"message {row.id} (n={n}): status={row.status} attempts={row.attempts} "
                f"history rows={row.rows} delivered rows={row.delivered} failed rows={row.failed}"
            )
    if bad:
        raise Unverified("history does not match one delivery per message:\n  " + "\n  ".join(bad))
    if len(seen) != expected.messages:
        raise Unverified(f"{expected.messages} messages but only {len(seen)} distinct sequence numbers")
    if failing != expected.failing:
        raise Unverified(f"expected {expected.failing} failing messages, found {failing}")
    want_rows = expected.messages + expected.failing
    if history_rows != want_rows:
        raise Unverified(f"expected {want_rows} history rows, found {history_rows}")
    if expected.relays and set(by_relay) - set(expected.relays):
        raise Unverified(f"history names unexpected relays: {sorted(set(by_relay) - set(expected.relays))}")
    return {"history_rows": history_rows, "by_relay": by_relay, "by_outcome": by_outcome}


def read_traces(directory: Path, route: str, expected: Expected) -> int:
    """Sum every relay's per-message call counts; each message ran once (twice if it failed first)."""
    files = sorted(directory.glob(f"{route}-*.bin"))
    if not files:
        raise Unverified(f"no handler trace for route {route!r} in {directory}: did the relays stop cleanly?")
    counts = bytearray(expected.messages)
    for path in files:
        for n, calls in enumerate(path.read_bytes()):
            if calls:
                if n >= expected.messages:
                    raise Unverified(f"handler ran for unknown message n={n}")
                counts[n] += calls
    calls_total = sum(counts)
    want = expected.messages + expected.failing
    if calls_total != want:
        raise Unverified(f"handlers ran {calls_total} times, expected {want}")
    if min(counts) < 1 or max(counts) > 2 or (expected.failing == 0 and max(counts) != 1):
        raise Unverified(f"a message ran {min(counts)} to {max(counts)} times")
    return calls_total


def read_handler_starts(samples: Path, committed: Mapping[int, float]) -> dict[int, float]:
    """The handler's start time per message number, from its samples file: one per commit, none twice."""
    started: dict[int, float] = {}
    for line in samples.read_text().splitlines():
        n_text, at = line.split()
        if int(n_text) in started:
            raise Unverified(f"handler started twice for n={n_text}")
        started[int(n_text)] = float(at)
    if set(started) != set(committed):
        raise Unverified(f"{len(started)} handler starts recorded for {len(committed)} commits")
    return started


def read_calls(directory: Path, route: str) -> int:
    return sum(json.loads(p.read_text())["calls"] for p in directory.glob(f"{route}-*.json"))


def drain_window(url: URL) -> tuple[datetime, datetime, datetime]:
    """First attempt start, last attempt finish, and the last message update (its outcome's write)."""
    a = outbox_attempt
    m = outbox_message
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            first, last = conn.execute(select(func.min(a.c.started_at), func.max(a.c.finished_at))).one()
            written = conn.execute(select(func.max(m.c.updated_at))).scalar_one()
    finally:
        engine.dispose()
    return first, last, written


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        raise Unverified("no samples")
    rank = min(len(ordered), max(1, math.ceil(pct / 100 * len(ordered))))
    return ordered[rank - 1]
