"""Retry schedule: capped exponential backoff with full jitter.

Full jitter (a uniform draw between zero and the exponential ceiling) spreads the
retries of many messages that failed together, for example when one endpoint went
down, so they do not return as a synchronised wave when it comes back.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ._exceptions import ConfigurationError

__all__ = ["Backoff"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before retry ``n`` is drawn from ``[0, min(cap, base * 2 ** (n - 1))]`` seconds."""

    base: float = 1.0
    cap: float = 300.0

    def __post_init__(self) -> None:
        for what, value in (("base", self.base), ("cap", self.cap)):
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigurationError(
                    f"backoff {what} must be a positive number of seconds, got {value!r}"
                )
        if self.cap < self.base:
            raise ConfigurationError(f"backoff cap ({self.cap}) must not be below its base ({self.base})")

    def ceiling(self, attempt: int) -> float:
        """The longest delay after failed attempt number ``attempt`` (counting from 1)."""
        if attempt < 1:
            raise ValueError(f"attempt counts from 1, got {attempt}")
        # 2 ** 1100 overflows a float; the cap is reached long before that.
        exponent = min(attempt - 1, 1000)
        return float(min(self.cap, self.base * 2.0**exponent))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return (rng or _rng).uniform(0.0, self.ceiling(attempt))


_rng = random.Random()
