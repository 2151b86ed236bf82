"""Circuit breakers keyed by destination, so one failing endpoint stops costing attempts.

States per key::

    closed ──(threshold consecutive failures)──▶ open ──(cooldown elapsed)──▶ half-open
      ▲                                          ▲                               │
      └────────────── trial succeeds ────────────┼──────── trial fails ──────────┘

While open, :meth:`CircuitBreaker.acquire` raises :class:`CircuitOpen` with the
seconds left. After the cooldown exactly one caller gets a trial permit; the
others keep getting :class:`CircuitOpen` until the trial reports. A trial that
never reports (its caller was cancelled) stops blocking after ``trial_timeout``.

The cool-down is the pause between two trial requests, a second by default: a
destination that is back is found within about a second, however long the
outage lasted. What keeps that cheap is that only one caller per destination
comes back for each trial: the first turned away asks to be that one
(:meth:`CircuitBreaker.volunteer`); the others park their messages until the
destination recovers (``RetryLater(until_recovered=...)``), and a successful
trial releases them all at once, in every relay (the board's
:meth:`~outbox._breaker_board.BreakerBoard.recovered`). A volunteer that never
comes back is replaced ``VOLUNTEER_GRACE`` seconds after its trial was due.

Thread-safe (one ``threading.Lock``), with no asyncio state: the same breaker
serves async handlers on any event loop (``acquire_checked``) and plain
handlers on worker threads (``acquire``).

::

    breaker = CircuitBreaker(threshold=5, cooldown=1.0)
    permit = breaker.acquire("api.example.com")    # raises CircuitOpen while open
    try:
        ok = deliver()
    except BaseException:
        permit.release()                           # no verdict on the destination
        raise
    permit.success() if ok else permit.failure()

Shared by every relay (``share``): a relay offers each breaker its run's
:class:`~outbox._breaker_board.BreakerBoard`, a copy of ``outbox_breaker`` read
about once a second. The breaker still decides in memory; what it learns from
the copy it follows (another relay opened a destination: open here too, until
the shared reopen time; the row is gone: a trial succeeded elsewhere, or an
operator reset it, so close here too), and what it decides (opened, reopened
after a failed trial, closed by a successful delivery) it hands to the board to
write. Each relay still sends at most one trial request per cool-down; the
first to succeed closes the breaker for all. Without a board, or while the
board cannot reach the table, the breaker is this process's alone, as before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from outbox import ConfigurationError
from outbox._breaker_board import BreakerBoard, SharedBreaker

__all__ = ["CircuitBreaker", "CircuitOpen", "Permit"]

#: While a half-open trial is in flight, the others ask again after this many seconds (at most).
TRIAL_WAIT = 1.0
#: A volunteer that has not asked for its trial this long after it was due is replaced.
VOLUNTEER_GRACE = 5.0
#: The longest a delivery about to be turned away waits for a fresh read of the shared breakers.
FRESH_WAIT = 1.0

log = logging.getLogger("outbox.integrations.breaker")


class CircuitOpen(Exception):
    """Deliveries to ``key`` are suspended for ``remaining`` more seconds."""

    def __init__(self, key: str, remaining: float, *, half_open: bool = False) -> None:
        state = "half-open, trial in progress" if half_open else "open"
        super().__init__(f"circuit breaker for {key} is {state}; retry in {remaining:.1f}s")
        self.key = key
        self.remaining = remaining
        self.half_open = half_open


@dataclass(slots=True)
class _State:
    failures: int = 0
    reopen_at: float | None = None  # None while closed; when open, the clock() time it turns half-open
    trial_started: float | None = None  # a half-open trial is in flight
    #: the shared row this state last followed (its ``updated_at``); None: none seen since it opened
    version: datetime | None = None
    #: clock() time by which the caller that volunteered for the next trial should have asked for it
    volunteer_until: float | None = None


class Permit:
    """Leave to make one call to a destination; report its verdict exactly once."""

    __slots__ = ("_breaker", "_done", "key", "pause", "route", "trial")

    def __init__(self, breaker: CircuitBreaker, key: str, trial: bool, route: str = "") -> None:
        self._breaker = breaker
        self._done = False
        self.key = key
        self.trial = trial
        self.route = route
        self.pause: float | None = None  # how long a failure that (re)opens the breaker keeps it open

    def success(self) -> None:
        """The destination answered sanely: close the breaker and reset its count."""
        if not self._done:
            self._done = True
            self._breaker._report(self, ok=True)

    def failure(self, *, pause: float | None = None) -> bool:
        """The destination is unhealthy (unreachable, timing out, 5xx); whether the breaker is open now.

        ``pause`` replaces the cool-down before the next trial, should this failure (re)open the breaker.
        """
        if not self._done:
            self._done = True
            self.pause = pause
            self._breaker._report(self, ok=False)
        return self._breaker.is_open(self.key)

    def release(self) -> None:
        """No verdict (refused before the call, or cancelled): a trial slot is freed."""
        if not self._done:
            self._done = True
            self._breaker._report(self, ok=None)


class CircuitBreaker:
    """Opens a key after ``threshold`` consecutive failures; one trial request every ``cooldown`` seconds.

    ``trial_timeout`` is how long an unreported trial keeps the others away (at
    least the cool-down): the request's own time limit.
    """

    def __init__(
        self,
        threshold: int = 5,
        cooldown: float = 1.0,
        *,
        trial_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ConfigurationError(f"breaker_threshold must be an integer >= 1, got {threshold!r}")
        if (
            isinstance(cooldown, bool)
            or not isinstance(cooldown, int | float)
            or not math.isfinite(cooldown)
            or cooldown <= 0
        ):
            raise ConfigurationError(f"breaker_cooldown must be a number of seconds > 0, got {cooldown!r}")
        self.threshold = threshold
        self.cooldown = float(cooldown)
        #: how long a caller turned away during a half-open trial waits before asking again
        self.trial_wait = min(TRIAL_WAIT, self.cooldown)
        #: how long a trial that never reports keeps the others away
        self.trial_timeout = max(self.cooldown, float(trial_timeout or 0.0))
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self._boards: list[BreakerBoard] = []  # the newest open one is followed

    def __repr__(self) -> str:
        return f"<CircuitBreaker threshold={self.threshold} cooldown={self.cooldown:g}s>"

    # -- shared by every relay --------------------------------------------------------------

    def share(self, board: BreakerBoard) -> None:
        """Follow ``board`` and write this breaker's decisions to it, until the board is closed."""
        with self._lock:
            self._boards = [b for b in self._boards if not b.closed and b is not board] + [board]
        board.listen(self)

    def _board(self) -> BreakerBoard | None:
        for board in reversed(self._boards):
            if not board.closed:
                return board
        return None

    @property
    def shared(self) -> bool:
        """Whether a board carries this breaker's news: only then can a recovery release parked messages."""
        with self._lock:
            return self._board() is not None

    def follow(self, board: BreakerBoard, shared: Mapping[str, SharedBreaker]) -> None:
        """A fresh copy of the shared table: open what another relay opened, close what is gone.

        Only destinations this breaker has met are followed (a new one is looked
        up when first asked for), and none with a decision of ours not written
        yet: the copy may predate it.
        """
        with self._lock:
            if board is not self._board():
                return
            for key, state in self._states.items():
                if board.pending(key):
                    continue
                row = shared.get(key)
                if row is None:
                    shared_once = state.version is not None or board.wrote_opening(key)
                    if state.reopen_at is not None and shared_once:
                        # It was in the table, and is not any more: closed by another relay's
                        # successful trial, an operator's reset, or a retry-now.
                        self._close(key, state, "closed elsewhere (a relay's trial, a reset or retry-now)")
                        # What this relay parked since that closing was released is released now.
                        board.unpark(key)
                    continue
                if row.version == state.version:
                    if state.reopen_at is None:
                        board.recovered(key)  # our closing never reached the table: once more
                    continue
                self._adopt(key, state, row)

    def _adopt(self, key: str, state: _State, row: SharedBreaker) -> None:
        if state.reopen_at is None:
            log.warning(
                "circuit breaker for %s opened by relay %s (route %s); pausing %.0fs",
                key,
                row.opened_by,
                row.handler,
                max(0.0, row.reopen_at - self._clock()),
                extra={"action": "breaker_open", "destination": key, "opened_by": row.opened_by},
            )
        state.version = row.version
        state.reopen_at = row.reopen_at

    def _close(self, key: str, state: _State, how: str) -> None:
        log.info(
            "circuit breaker for %s %s",
            key,
            how,
            extra={"action": "breaker_closed", "destination": key},
        )
        # The key stays, reported closed, so a metrics gauge that saw it open goes back to 0.
        state.failures, state.reopen_at, state.trial_started = 0, None, None
        state.volunteer_until = None

    # -- deciding ---------------------------------------------------------------------------

    def acquire(self, key: str, *, route: str = "") -> Permit:
        """A permit to call ``key``, or :class:`CircuitOpen` with the time left to wait.

        ``route`` names the route delivering: a breaker it opens is recorded under it.
        """
        with self._lock:
            state = self._states.get(key)
            if state is None or state.reopen_at is None:
                board = self._board() if self._boards else None
                row = None if board is None else board.get(key)
                if row is None or (state is not None and row.version == state.version):
                    return Permit(self, key, trial=False, route=route)
                if board is not None and board.pending(key):
                    return Permit(self, key, trial=False, route=route)
                state = self._states.setdefault(key, _State())
                self._adopt(key, state, row)
                assert state.reopen_at is not None
            now = self._clock()
            remaining = state.reopen_at - now
            if remaining > 0:
                raise CircuitOpen(key, remaining)
            if state.trial_started is not None and now - state.trial_started < self.trial_timeout:
                # Someone is already probing: a caller that cannot park asks again soon, since a trial
                # that succeeds closes the breaker at once.
                left = state.trial_started + self.trial_timeout - now
                raise CircuitOpen(key, min(left, self.trial_wait), half_open=True)
            state.trial_started = now
            state.volunteer_until = None  # the trial is here; whoever fails it next volunteers anew
            return Permit(self, key, trial=True, route=route)

    def volunteer(self, key: str) -> bool:
        """Whether a caller just turned away should come back for the next trial (True) or park.

        One caller per destination at a time: the first to ask since the last
        trial began, or since the volunteer before it failed to show up
        ``VOLUNTEER_GRACE`` seconds after its trial was due.
        """
        with self._lock:
            state = self._states.get(key)
            if state is None or state.reopen_at is None:
                return False  # closed meanwhile: nothing to wait for
            now = self._clock()
            if state.trial_started is not None and now - state.trial_started < self.trial_timeout:
                return False  # a trial is in flight; if it fails, its caller volunteers first
            if state.volunteer_until is not None and now <= state.volunteer_until:
                return False
            state.volunteer_until = max(now, state.reopen_at) + VOLUNTEER_GRACE
            return True

    async def acquire_checked(self, key: str, *, route: str = "") -> Permit:
        """:meth:`acquire`, but a refusal is first checked against a fresh read of the shared breakers.

        The copy a breaker follows may be a second old, and an operator's
        reset or retry-now of a moment ago is what made this delivery due: it
        must not be turned away for a whole cool-down by what the copy said
        before. Only a refusal waits (for one read shared by every delivery
        refused meanwhile, at most ``FRESH_WAIT``); without a board, or while
        the board cannot read the table, the refusal stands at once.
        """
        try:
            return self.acquire(key, route=route)
        except CircuitOpen:
            with self._lock:
                board = self._board() if self._boards else None
            if board is None or not board.readable:
                raise
            try:
                async with asyncio.timeout(FRESH_WAIT):
                    fresh = await asyncio.wrap_future(board.read_after())
            except TimeoutError:
                fresh = False
            if not fresh:
                raise
        return self.acquire(key, route=route)

    def _report(self, permit: Permit, ok: bool | None) -> None:
        with self._lock:
            state = self._states.get(permit.key)
            board = self._board() if self._boards else None
            if state is None:
                if ok is None or (ok and (board is None or board.get(permit.key) is None)):
                    return  # healthy destinations keep no state
                state = self._states[permit.key] = _State()
            if permit.trial:
                state.trial_started = None
            if ok is None:
                return
            if ok:
                was_open = state.reopen_at is not None
                if was_open:
                    self._close(permit.key, state, "closed")
                state.failures = 0
                if board is not None and (was_open or board.get(permit.key) is not None):
                    board.recovered(permit.key)  # for every relay
                return
            state.failures += 1
            if permit.trial or (state.reopen_at is None and state.failures >= self.threshold):
                pause = self.cooldown if permit.pause is None else permit.pause
                reopening = state.reopen_at is not None
                state.reopen_at = self._clock() + pause
                # A failed trial is the same outage: one line when it opens, not one per trial.
                log.log(
                    logging.DEBUG if reopening else logging.WARNING,
                    "circuit breaker for %s %s after %d consecutive failures; next trial in %.0fs",
                    permit.key,
                    "stays open" if reopening else "opened",
                    state.failures,
                    pause,
                    extra={"action": "breaker_open", "destination": permit.key},
                )
                if board is not None:
                    board.opened(permit.key, permit.route or "?", state.failures, pause)

    def is_open(self, key: str) -> bool:
        with self._lock:
            state = self._states.get(key)
            return state is not None and state.reopen_at is not None

    def states(self) -> dict[str, bool]:
        """``{key: is_open}`` for every key that has failed at least once (metrics read this)."""
        with self._lock:
            return {key: s.reopen_at is not None for key, s in self._states.items()}
