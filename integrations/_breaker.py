"""Circuit breakers keyed by destination, so one failing endpoint stops costing attempts.

States per key::

    closed ──(threshold consecutive failures)──▶ open ──(cooldown elapsed)──▶ half-open
      ▲                                          ▲                               │
      └────────────── trial succeeds ────────────┼──────── trial fails ──────────┘

While open, :meth:`CircuitBreaker.acquire` raises :class:`CircuitOpen` with the
seconds left. After the cooldown exactly one caller gets a trial permit; the
others keep getting :class:`CircuitOpen` until the trial reports, told to ask
again within ``TRIAL_WAIT`` (a second), so a successful trial lets them all
through at once instead of a cool-down later. A trial that never reports (its
caller was cancelled) stops blocking after another cooldown.

Thread-safe (one ``threading.Lock``), with no asyncio state: the same breaker
serves async handlers on any event loop and plain handlers on worker threads.

::

    breaker = CircuitBreaker(threshold=5, cooldown=30.0)
    permit = breaker.acquire("api.example.com")    # raises CircuitOpen while open
    try:
        ok = deliver()
    except BaseException:
        permit.release()                           # no verdict on the destination
        raise
    permit.success() if ok else permit.failure()
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from outbox import ConfigurationError

__all__ = ["CircuitBreaker", "CircuitOpen", "Permit"]

#: While a half-open trial is in flight, the others ask again after this many seconds (at most).
TRIAL_WAIT = 1.0

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
    opened_at: float | None = None  # None while closed
    trial_started: float | None = None  # a half-open trial is in flight


class Permit:
    """Leave to make one call to a destination; report its verdict exactly once."""

    __slots__ = ("_breaker", "_done", "key", "trial")

    def __init__(self, breaker: CircuitBreaker, key: str, trial: bool) -> None:
        self._breaker = breaker
        self._done = False
        self.key = key
        self.trial = trial

    def success(self) -> None:
        """The destination answered sanely: close the breaker and reset its count."""
        if not self._done:
            self._done = True
            self._breaker._report(self, ok=True)

    def failure(self) -> None:
        """The destination is unhealthy (unreachable, timing out, 5xx)."""
        if not self._done:
            self._done = True
            self._breaker._report(self, ok=False)

    def release(self) -> None:
        """No verdict (refused before the call, or cancelled): a trial slot is freed."""
        if not self._done:
            self._done = True
            self._breaker._report(self, ok=None)


class CircuitBreaker:
    """Opens a key after ``threshold`` consecutive failures, for ``cooldown`` seconds."""

    def __init__(
        self, threshold: int = 5, cooldown: float = 30.0, *, clock: Callable[[], float] = time.monotonic
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
        self._clock = clock
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}

    def __repr__(self) -> str:
        return f"<CircuitBreaker threshold={self.threshold} cooldown={self.cooldown:g}s>"

    def acquire(self, key: str) -> Permit:
        """A permit to call ``key``, or :class:`CircuitOpen` with the time left to wait."""
        with self._lock:
            state = self._states.get(key)
            if state is None or state.opened_at is None:
                return Permit(self, key, trial=False)
            now = self._clock()
            remaining = state.opened_at + self.cooldown - now
            if remaining > 0:
                raise CircuitOpen(key, remaining)
            if state.trial_started is not None and now - state.trial_started < self.cooldown:
                # Someone is already probing. Come back soon, not when the trial must have reported:
                # a trial that succeeds closes the breaker at once, and the messages waiting behind it
                # should follow within a moment, not a whole cool-down later.
                left = state.trial_started + self.cooldown - now
                raise CircuitOpen(key, min(left, self.trial_wait), half_open=True)
            state.trial_started = now
            return Permit(self, key, trial=True)

    def _report(self, permit: Permit, ok: bool | None) -> None:
        with self._lock:
            state = self._states.get(permit.key)
            if state is None:
                if ok is not False:
                    return  # healthy destinations keep no state
                state = self._states[permit.key] = _State()
            if permit.trial:
                state.trial_started = None
            if ok is None:
                return
            if ok:
                if state.opened_at is not None:
                    log.info(
                        "circuit breaker for %s closed",
                        permit.key,
                        extra={"action": "breaker_closed", "destination": permit.key},
                    )
                # The key stays, reported closed, so a metrics gauge that saw it open goes back to 0.
                state.failures, state.opened_at, state.trial_started = 0, None, None
                return
            state.failures += 1
            if permit.trial or (state.opened_at is None and state.failures >= self.threshold):
                state.opened_at = self._clock()
                log.warning(
                    "circuit breaker for %s opened after %d consecutive failures; pausing %.0fs",
                    permit.key,
                    state.failures,
                    self.cooldown,
                    extra={"action": "breaker_open", "destination": permit.key},
                )

    def is_open(self, key: str) -> bool:
        with self._lock:
            state = self._states.get(key)
            return state is not None and state.opened_at is not None

    def states(self) -> dict[str, bool]:
        """``{key: is_open}`` for every key that has failed at least once (metrics read this)."""
        with self._lock:
            return {key: s.opened_at is not None for key, s in self._states.items()}
