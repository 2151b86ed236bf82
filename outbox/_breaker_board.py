"""The circuit breakers every relay shares, as one relay sees them: ``outbox_breaker``, read once a second.

A handler's breaker decides in memory, on every delivery, without a round trip:
that is what keeps an open breaker cheap. A :class:`BreakerBoard` is how those
decisions reach the other relays and theirs reach this one. A thread of its own
reads the table every ``interval`` seconds (a handful of rows: only open and
half-open breakers have one) and hands the copy to the breakers listening
(:meth:`BreakerBoard.listen`), which follow it: an opening elsewhere opens
theirs until the shared reopen time, a row gone (a trial succeeded elsewhere,
an operator reset it, ``retry-now`` cleared it) closes theirs. The same thread
writes what this relay decides, as soon as it decides it: an opening, a failed
trial's reopening, a successful trial's closing (``_breaker_writes``).

It is also how a handler reports that a destination is back, breaker or not
(a broker publisher that reconnected): :meth:`BreakerBoard.recovered` closes
the destination's breaker and releases the messages parked on it
(``outbox_message.parked_on``, ``outbox._parking``) for every relay, and
:meth:`BreakerBoard.unpark` releases them alone (a breaker that followed
another relay's closing). Each release is made at once and once more
``RELEASE_ECHO`` seconds later: a message this relay decided to park just
before the news came may have its outcome written just after the first
release, and must not then wait out its whole safety delay.

Nothing here can stop a delivery: no statement runs on the event loop or in a
handler's call, only this thread waits for the database. When it cannot read
or write (the database is away, the table not migrated yet, the role not
granted), each relay's breakers are its own, as before, until a read succeeds
again; that is logged once per streak of failures (actions ``breaker_error``
and ``breaker_ok``). A write that failed is tried again after the next read
that succeeds, unless a newer decision about the destination came meanwhile.

Times in the copy are this host's monotonic clock: PostgreSQL answers how many
seconds are left until each reopen time by its own clock, so relay hosts whose
clocks disagree still reopen together.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ProgrammingError

from ._breaker_writes import Decision, write_decision
from ._first_line import first_line
from ._parking import unpark
from ._tables import outbox_breaker

__all__ = ["MAX_COOLDOWN", "READ_INTERVAL", "BreakerBoard", "BreakerListener", "SharedBreaker"]

#: Seconds between two reads of the table: how soon a relay follows another's opening, or a reset.
READ_INTERVAL = 1.0
#: The longest cool-down the table records (migration outbox_0019): a longer one is written as this.
MAX_COOLDOWN = 2_592_000.0
#: How long a closing relay waits for the decisions it has not written yet.
FLUSH_TIMEOUT = 2.0
#: A release of parked messages is made again this many seconds later, for outcomes written late.
RELEASE_ECHO = 1.0

log = logging.getLogger("outbox.breakers")
b = outbox_breaker


@dataclass(frozen=True, slots=True)
class SharedBreaker:
    """One row of ``outbox_breaker`` as last read: a destination whose breaker is open or half-open."""

    destination: str
    handler: str  # the route whose deliveries opened it
    opened_by: str  # that relay's id
    reopen_at: float  # this host's time.monotonic() when it turns half-open
    version: datetime  # updated_at: a reopening (or a new opening) changes it


class BreakerListener(Protocol):
    def follow(self, board: BreakerBoard, shared: Mapping[str, SharedBreaker]) -> None:
        """A fresh copy of the table; called on the board's thread, never with the board's lock held."""


class BreakerBoard:
    """One relay's view of the shared breakers; ``start()`` reads once, then a thread keeps it current."""

    def __init__(
        self,
        engine: Engine,
        relay_id: str,
        *,
        interval: float = READ_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.relay_id = relay_id
        self.interval = interval
        self._clock = clock
        self._server_clock = engine.dialect.name == "postgresql"
        self._lock = threading.Condition()
        self._queued: dict[str, Decision] = {}  # latest decision per destination, not written yet
        self._writing: set[str] = set()  # taken off the queue, being written now
        self._retry: dict[str, Decision] = {}  # writes that failed: queued again after the next good read
        self._recorded: set[str] = set()  # openings written since the last read (see wrote_opening)
        self._waiters: list[Future[bool]] = []  # callers of read_after waiting for the next read
        self._release_now: set[str] = set()  # destinations whose parked messages to release now
        self._release_again: dict[str, float] = {}  # ... and when to release them once more
        self._release_retry: set[str] = set()  # releases that failed: made after the next good read
        #: called on the board's thread with (destination, count) after a release freed messages
        self.on_release: Callable[[str, int], None] = lambda destination, count: None
        self._listeners: list[BreakerListener] = []
        self._shared: dict[str, SharedBreaker] | None = None  # None: the last read failed (or none yet)
        self._failing = False  # logged once per streak: until reads and writes both work again
        self._last_ok: dict[str, bool | None] = {"read": None, "write": None, "release": None}
        self._closed = False
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<BreakerBoard relay={self.relay_id} every {self.interval:g}s>"

    # -- read by the breakers (any thread) --------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def get(self, destination: str) -> SharedBreaker | None:
        """The destination's shared breaker as last read; None when it has none, or the read failed."""
        shared = self._shared  # replaced whole by each read: one reference, no lock needed
        return None if shared is None else shared.get(destination)

    def pending(self, destination: str) -> bool:
        """Whether a decision about ``destination`` is not in the table yet: a read may predate it."""
        with self._lock:
            return destination in self._queued or destination in self._writing or destination in self._retry

    def wrote_opening(self, destination: str) -> bool:
        """Whether this relay wrote the destination's opening since the read before the current one.

        A row this relay wrote that the current read finds gone was closed by
        someone else (a reset, say) before this relay saw the row itself.
        """
        with self._lock:
            return destination in self._recorded

    @property
    def readable(self) -> bool:
        """Whether the last read succeeded: while not, nothing is worth waiting for."""
        return self._shared is not None and not self._closed

    def read_after(self) -> Future[bool]:
        """A future done when a read that starts after this call has been followed (True) or failed.

        A breaker about to turn a delivery away asks for one: an operator's
        reset or a retry-now a moment ago must not be missed by a copy that
        is up to ``interval`` seconds old. Callers meanwhile share one read.
        """
        future: Future[bool] = Future()
        with self._lock:
            if self._closed:
                future.set_result(False)
                return future
            self._waiters.append(future)
            self._lock.notify()
        return future

    def listen(self, listener: BreakerListener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    # -- decisions to write (any thread, never waits for the database) ----------------------

    def opened(self, destination: str, route: str, failures: int, cooldown: float) -> None:
        """This relay opened (or, after a failed trial, reopened) the destination's breaker."""
        self._queue(destination, Decision(True, route, max(1, failures), min(cooldown, MAX_COOLDOWN)))

    def recovered(self, destination: str) -> None:
        """The destination works again: its breaker closes and what is parked on it goes, for every relay."""
        self._queue(destination, Decision(False))
        self.unpark(destination)

    def unpark(self, destination: str) -> None:
        """Release the messages parked on ``destination``: now, and again ``RELEASE_ECHO`` seconds later."""
        with self._lock:
            if self._closed:
                return
            self._release_now.add(destination)
            self._release_again[destination] = self._clock() + RELEASE_ECHO
            self._lock.notify()

    def _queue(self, destination: str, write: Decision) -> None:
        with self._lock:
            if self._closed:
                return
            self._queued.pop(destination, None)  # the latest decision, in the order they came
            self._retry.pop(destination, None)
            self._queued[destination] = write
            self._recorded.discard(destination)
            self._lock.notify()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Read once (blocking: call it from a thread), then keep reading and writing on a thread."""
        self._read()
        self._thread = threading.Thread(target=self._run, name="outbox-breakers", daemon=True)
        self._thread.start()

    def close(self, timeout: float = FLUSH_TIMEOUT) -> None:
        """Write what is queued (for at most ``timeout`` seconds), then stop reading."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, []
            self._lock.notify()
        _answer(waiters, False)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        due = self._clock() + self.interval
        while True:
            with self._lock:
                while not (
                    self._queued or self._waiters or self._closed or self._release_now
                ) and self._clock() < self._wake_at(due):
                    self._lock.wait(max(0.0, self._wake_at(due) - self._clock()))
                writes, self._queued = self._queued, {}
                self._writing = set(writes)
                releases, self._release_now = self._release_now, set()
                now = self._clock()
                for destination, at in list(self._release_again.items()):
                    if at <= now:
                        releases.add(destination)
                        del self._release_again[destination]
                closing = self._closed
            for destination, write in writes.items():
                self._write(destination, write)
            with self._lock:
                self._writing = set()
                # Those waiting now get a read that starts after they asked; later ones, the next.
                waiters, self._waiters = self._waiters, []
            for destination in sorted(releases):  # after the closings: a release follows its breaker
                self._release(destination)
            if closing:
                _answer(waiters, False)
                return
            if waiters or self._clock() >= due:
                read = self._read()
                _answer(waiters, read)
                due = self._clock() + self.interval
                if read:
                    self._requeue()

    def _wake_at(self, due: float) -> float:
        """The next read, or a release due to be made again before it (called with the lock held)."""
        return min(due, *self._release_again.values()) if self._release_again else due

    def _requeue(self) -> None:
        """The table answers again: what could not be written is written now, unless overtaken."""
        with self._lock:
            for destination, write in self._retry.items():
                self._queued.setdefault(destination, write)
            self._retry = {}
            self._release_now |= self._release_retry
            self._release_retry = set()

    # -- the statements ----------------------------------------------------------------------

    def _read(self) -> bool:
        try:
            read_at = self._clock()
            with self.engine.connect() as conn:
                rows = conn.execute(self._select()).all()
            now = datetime.now(UTC)
            shared = {
                row.destination: SharedBreaker(
                    row.destination,
                    row.handler,
                    row.opened_by,
                    read_at + self._left(row.left, now),
                    row.updated_at,
                )
                for row in rows
            }
        except Exception as exc:  # the database, a driver, a bug: never the thread's end
            self._shared = None
            self._failed("read", exc)
            return False
        self._shared = shared
        self._ok("read")
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener.follow(self, shared)
            except Exception:
                log.exception(
                    "a circuit breaker could not follow the shared state",
                    extra={"action": "breaker_error", "relay_id": self.relay_id},
                )
        with self._lock:
            # Followed: a row read is known by its version now, and a row gone was closed above.
            self._recorded.clear()
        return True

    def _select(self) -> Any:
        if self._server_clock:  # the seconds left by the server's clock, not this host's
            left: Any = func.extract("epoch", b.c.reopen_at - func.now())
        else:
            left = b.c.reopen_at
        return select(b.c.destination, b.c.handler, b.c.opened_by, b.c.updated_at, left.label("left"))

    @staticmethod
    def _left(value: Any, now: datetime) -> float:
        seconds = (value - now).total_seconds() if isinstance(value, datetime) else float(value)
        return seconds if math.isfinite(seconds) else 0.0

    def _write(self, destination: str, write: Decision) -> None:
        try:
            with self.engine.begin() as conn:
                write_decision(conn, self.relay_id, destination, write)
        except Exception as exc:
            self._failed("write", exc)
            with self._lock:
                if destination not in self._queued:  # not overtaken by a newer decision meanwhile
                    self._retry[destination] = write
            return
        if write.opened:
            with self._lock:
                if destination not in self._queued:  # a newer decision is on its way
                    self._recorded.add(destination)
        self._ok("write")

    def _release(self, destination: str) -> None:
        """Make what is parked on ``destination`` due now (``outbox_unpark``), in a transaction of its own."""
        try:
            with self.engine.begin() as conn:
                released = unpark(conn, destination)
        except Exception as exc:
            self._failed("release", exc)
            if not isinstance(exc, ProgrammingError):  # not granted, not migrated: no use trying again
                with self._lock:
                    self._release_retry.add(destination)
            return
        self._ok("release")
        if not released:
            return
        log.info(
            "%d message(s) parked on %s are due now: it is back",
            released,
            destination,
            extra={
                "action": "unparked",
                "destination": destination,
                "count": released,
                "relay_id": self.relay_id,
            },
        )
        try:
            self.on_release(destination, released)
        except Exception:
            log.exception("on_release failed", extra={"action": "breaker_error", "relay_id": self.relay_id})

    # -- one line per streak of failures -------------------------------------------------------

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._last_ok[what] = False
            if self._failing:
                return
            self._failing = True
        if what == "release":
            log.warning(
                "cannot release the messages parked on a destination that is back (outbox_unpark: %s);"
                " they wait out their delay until it can",
                first_line(exc),
                extra={"action": "breaker_error", "relay_id": self.relay_id},
            )
            return
        log.warning(
            "cannot %s the shared circuit breakers in outbox_breaker (%s); this relay's breakers decide"
            " on their own until it can",
            what,
            first_line(exc),
            extra={"action": "breaker_error", "relay_id": self.relay_id},
        )

    def _ok(self, what: str) -> None:
        with self._lock:
            self._last_ok[what] = True
            if not self._failing or False in self._last_ok.values():
                return
            self._failing = False
        log.info(
            "the shared circuit breakers in outbox_breaker are read and written again",
            extra={"action": "breaker_ok", "relay_id": self.relay_id},
        )


def _answer(waiters: list[Future[bool]], result: bool) -> None:
    for future in waiters:
        if future.set_running_or_notify_cancel():  # False: its caller gave up waiting
            future.set_result(result)
