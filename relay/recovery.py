"""Taking back the messages whose lease lapsed, reading only the leases that lapsed since the last look.

A running message's lease (``locked_until``) is in ``ix_outbox_message_lease``,
which holds running rows only (migration ``outbox_0026``). While a transaction
holds back the xmin horizon (an idle ``BEGIN``, a long report), that index
keeps an entry for every row that was ever running: each claim adds one and
nothing may remove the old ones. A look for every lease that ran out before
now walks all of them, and every one points at a row delivered long ago:
200-300 ms every 10 s after ten minutes of a held transaction at 1,000
messages a second, growing with the hold. So a look starts where the last one
left off (:class:`RecoveryWindow`): it reads the leases that ran out since,
the claims of about one recovery period, and never the ones behind it.

What a look reads but does not take holds its window back at that lease: a
row another relay was recovering at that instant (``outbox_recover`` skips a
locked row), or the 501st of a crash's leases. What no look from the window
would see, a lease written below it, takes a claim that outlasts its own
lease, or a clock set back (SQLite stamps leases with the relay's clock); a
full look, at start and then every :data:`FULL_LOOK_EVERY` seconds (a hundred
times its own cost apart while that is longer), takes those.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import bindparam, func, literal, select, update

from outbox import Backoff, outbox_message

from . import outcomes
from .claimed import CLAIMED
from .clock import utcnow
from .documents import undecodable

if TYPE_CHECKING:
    from .store import Store

__all__ = ["FULL_LOOK_EVERY", "Look", "Recovered", "RecoveryWindow", "recover_expired"]

m = outbox_message

#: Seconds between full looks (every lease that ran out), while one is cheap.
FULL_LOOK_EVERY: Final = 60.0
#: How many times its own duration apart full looks run, at least.
_FULL_LOOK_SPACING: Final = 100.0


@dataclass(slots=True)
class Recovered:
    """A message taken back from a relay whose lease expired."""

    row: Any  # the claimed columns, plus locked_by, locked_until and updated_at
    dead: bool
    retry_in: float
    reason: str
    #: why its payload or headers cannot be decoded, which made it dead whatever its attempts
    undecodable: str | None = None


@dataclass(frozen=True, slots=True)
class Look:
    """One look's recoveries, and the lease the next look reads from."""

    recovered: list[Recovered]
    resume_from: datetime


class RecoveryWindow:
    """Where the next look for lapsed leases starts reading: from the last look's end, or everything."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._from: datetime | None = None
        self._full_due = float("-inf")

    def since(self) -> datetime | None:
        """The earliest lease the next look reads; None for a full look."""
        if self._from is None or self._clock() >= self._full_due:
            return None
        return self._from

    def looked(self, since: datetime | None, look: Look, seconds: float) -> None:
        """A look from ``since`` ended as ``look`` after ``seconds``: the next reads from where it stopped."""
        self._from = look.resume_from
        if since is None:
            self._full_due = self._clock() + max(FULL_LOOK_EVERY, seconds * _FULL_LOOK_SPACING)


def recover_expired(
    store: Store,
    backoffs: dict[str, Backoff],
    rng: random.Random,
    *,
    since: datetime | None = None,
    limit: int = 500,
) -> Look:
    """Take back messages whose relay stopped renewing its lease (it crashed or hung).

    Reads the running messages whose lease ran out before now and, with
    ``since``, not before ``since``; in lease order, ``limit`` at most. Each
    recovery appends a ``lease_expired`` attempt naming the relay that held
    it; the message is retried with its route's backoff, or goes dead if that
    was its last attempt, or if its payload or headers cannot be decoded
    (``documents.py``: no handler could ever be given it, and a relay that
    crashed on it before it was handled that way left it here). Returns what
    was recovered, with the message's columns, so the relay can announce each
    retry or death, and where the next look starts.
    """
    with store.engine.begin() as conn:
        # PostgreSQL: the server's now(), the clock every lease is stamped with; the transaction's,
        # so the same in the read below.
        now: datetime = conn.execute(select(func.now())).scalar_one() if store.in_database else utcnow()
        expired = select(*CLAIMED, m.c.locked_by, m.c.locked_until, m.c.updated_at).where(
            m.c.status == "running", m.c.locked_until < literal(now, type_=m.c.locked_until.type)
        )
        if since is not None:
            expired = expired.where(m.c.locked_until >= literal(since, type_=m.c.locked_until.type))
        rows = list(conn.execute(expired.order_by(m.c.locked_until).limit(limit)))
        if store.in_database or not rows:
            recovered = []
        else:
            recovered = _recover_here(store, conn, rows, backoffs, rng)
    if store.in_database and rows:
        recovered = _recover_in_database(store, rows, backoffs, rng)
    taken = {item.row.id for item in recovered}
    resume_from = rows[-1].locked_until if len(rows) >= limit else now
    left = [row.locked_until for row in rows if row.id not in taken]
    return Look(recovered, min([resume_from, *left]))


def _recover_here(
    store: Store, conn: Any, rows: list[Any], backoffs: dict[str, Backoff], rng: random.Random
) -> list[Recovered]:
    """SQLite: take back each row read, in the read's transaction; its history rows with it."""
    now = store.clock.now()
    finished = utcnow()
    # Expiry is checked again, row by row: where FOR UPDATE is ignored (SQLite), a lease
    # renewed between the SELECT and here stays with its relay and leaves no history.
    base = update(m).where(m.c.id == bindparam("mid"), m.c.status == "running", m.c.locked_until < now)
    to_retry = base.values(
        status="pending",
        locked_by=None,
        locked_until=None,
        available_at=store.clock.later("later"),
        last_error=bindparam("err"),
        updated_at=now,
    )
    to_dead = base.values(
        status="dead", locked_by=None, locked_until=None, last_error=bindparam("err"), updated_at=now
    )
    history = []
    recovered = []
    for row in rows:
        reason = f"lease held by relay {row.locked_by} expired at {row.locked_until.isoformat()}"
        unusable = undecodable(row)
        if unusable is not None:
            reason = f"{reason}; {unusable}"
        last = row.attempts >= row.max_attempts or unusable is not None
        backoff = backoffs.get(row.handler)
        delay = backoff.delay(max(row.attempts, 1), rng) if backoff and not last else 0.0
        params: dict[str, Any] = {"mid": row.id, "err": reason}
        if last:
            taken = conn.execute(to_dead, params).rowcount
        else:
            params["later"] = store.clock.bind_later(timedelta(seconds=delay))
            taken = conn.execute(to_retry, params).rowcount
        if not taken:
            continue
        recovered.append(Recovered(row, dead=last, retry_in=delay, reason=reason, undecodable=unusable))
        history.append(
            {
                "message_id": row.id,
                "attempt": row.attempts,
                "outcome": "lease_expired",
                "started_at": row.updated_at,
                "finished_at": finished,
                "duration_ms": None,
                "relay_id": row.locked_by,
                "error_type": "LeaseExpired",
                "error": reason,
                "detail": {"recovered_by": store.relay_id, "dead": last, "retry_in": round(delay, 3)},
            }
        )
    if history:
        conn.execute(outcomes.history_insert(store.engine), history)
    return recovered


def _recover_in_database(
    store: Store, read: list[Any], backoffs: dict[str, Backoff], rng: random.Random
) -> list[Recovered]:
    """PostgreSQL: let ``outbox_recover`` take back each lease read that is still expired.

    The read took no lock (the relay's role may not lock what it may not
    update); the function locks each row, skipping one another relay is
    recovering, checks the lease is still expired and the attempt the same,
    and writes the message and its ``lease_expired`` row itself. A message on
    its last attempt goes dead there whatever this relay decides.
    """
    rows = {row.id: row for row in read}
    notes: dict[int, str | None] = {}
    decisions = []
    for row in rows.values():
        notes[row.id] = unusable = undecodable(row)
        last = row.attempts >= row.max_attempts or unusable is not None
        backoff = backoffs.get(row.handler)
        delay = backoff.delay(max(row.attempts, 1), rng) if backoff and not last else 0.0
        dead = unusable is not None
        decision = {"id": row.id, "attempt": row.attempts, "dead": dead, "delay": delay, "note": unusable}
        decisions.append(decision)
    params = {"me": store.relay_id, "decisions": json.dumps(decisions)}
    with store.autocommit.connect() as conn:
        taken = list(conn.exec_driver_sql(store.calls().recover, params))
    return [
        Recovered(rows[t.message_id], t.dead, t.retry_in, t.reason, undecodable=notes[t.message_id])
        for t in taken
    ]
