"""A token-bucket rate limiter shared by every delivery of one relay, async or threaded.

The state is a single "next free slot" time behind a ``threading.Lock``, never
an asyncio primitive, so one limiter serves handlers on any event loop (the
relay opens a new loop per ``run_until_idle()``) and plain handlers on worker
threads alike. Each caller reserves the next slot under the lock and sleeps
outside it, so concurrent callers queue up in arrival order.

::

    limiter = RateLimiter(rate=5, burst=2)     # 5 per second, two at once after a quiet spell
    await limiter.acquire()                    # on an event loop
    limiter.acquire_sync()                     # on a worker thread
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

from outbox import ConfigurationError

__all__ = ["RateLimited", "RateLimiter", "RateLimiters"]


class RateLimited(Exception):
    """The wait for a slot would exceed the caller's ``max_wait``; nothing was reserved."""

    def __init__(self, wait: float) -> None:
        super().__init__(f"rate limit: next slot in {wait:.3f}s")
        self.wait = wait


def _check_rate(rate: object, burst: object) -> tuple[float, int]:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
        raise ConfigurationError(f"rate limit must be a number of events per second > 0, got {rate!r}")
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ConfigurationError(f"rate limit burst must be an integer >= 1, got {burst!r}")
    return float(rate), burst


class RateLimiter:
    """At most ``rate`` acquisitions per second on average, ``burst`` of them back to back."""

    def __init__(self, rate: float, burst: int = 1, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = _check_rate(rate, burst)
        self._interval = 1.0 / self.rate
        self._clock = clock
        self._lock = threading.Lock()
        # The theoretical arrival time of the next acquisition (GCRA): slots before it are taken.
        self._next = -math.inf

    def __repr__(self) -> str:
        return f"<RateLimiter {self.rate:g}/s burst={self.burst}>"

    def _reserve(self, max_wait: float | None) -> float:
        with self._lock:
            now = self._clock()
            start = max(self._next, now)
            wait = max(0.0, start - now - (self.burst - 1) * self._interval)
            if max_wait is not None and wait > max_wait:
                raise RateLimited(wait)
            self._next = start + self._interval
            return wait

    async def acquire(self, max_wait: float | None = None) -> None:
        """Wait for a slot on the running event loop.

        With ``max_wait``, raise :class:`RateLimited` instead of waiting longer
        than that (a caller that would rather reschedule than hold a worker).
        """
        wait = self._reserve(max_wait)
        if wait > 0:
            await asyncio.sleep(wait)

    def acquire_sync(self, max_wait: float | None = None) -> None:
        """Wait for a slot on the calling thread; safe from any number of threads."""
        wait = self._reserve(max_wait)
        if wait > 0:
            time.sleep(wait)


class RateLimiters:
    """One :class:`RateLimiter` per key (a destination host, an SMTP provider), made on first use."""

    def __init__(self, rate: float, burst: int = 1, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = _check_rate(rate, burst)
        self._clock = clock
        self._lock = threading.Lock()
        self._limiters: dict[str, RateLimiter] = {}

    def __getitem__(self, key: str) -> RateLimiter:
        with self._lock:
            limiter = self._limiters.get(key)
            if limiter is None:
                limiter = self._limiters[key] = RateLimiter(self.rate, self.burst, clock=self._clock)
            return limiter
