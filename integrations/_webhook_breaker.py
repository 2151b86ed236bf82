"""The webhook handler and its circuit breaker: who sends, who probes, who parks, what counts.

While a destination's breaker is open, one delivery per relay comes back for
each trial request (it *volunteers*, :meth:`CircuitBreaker.volunteer`: it is
rescheduled, uncounted, for the end of the cool-down, and a failed trial's
delivery for the end of the next), and every other delivery is parked on the
destination (``RetryLater(until_recovered=...)``) with a long safety delay
(``PARKED_DELAY``). A successful trial closes the breaker for every relay and
releases everything parked on it at once.

An answer that says only that the receiver is unavailable (it could not be
reached, or answered 502, 503 or 504) uses no attempt once it leaves the
breaker open: a trial's, the one that opened it, any that came while it was
open. The failures before it opens count, as any failure of a healthy-looking
destination does: one of them may be the message's own fault. So does a failed
trial that may be (a 500, a timeout), and the next trial then waits
``COUNTED_TRIAL_PAUSE``, so such an outage uses up the messages' attempts no
faster than one trial per half minute. Without a board (a handler called
outside a relay) nothing could report the recovery, so nothing parks: a
turned-away delivery waits out the cool-down.
"""

from __future__ import annotations

from typing import Any

from outbox import RetryLater

from ._breaker import CircuitBreaker, CircuitOpen, Permit
from ._webhook_http import Target

__all__ = ["PARKED_DELAY", "behind_breaker", "permit"]

#: The longest a parked delivery waits when no recovery is reported (a relay lost, say).
PARKED_DELAY = 60.0
#: After a failed trial that counted (a 500, a timeout: perhaps the message), the next waits this long.
COUNTED_TRIAL_PAUSE = 30.0
#: Answers that say only that the receiver is unavailable, nothing about the message.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
_UNREACHABLE = frozenset({"unreachable", "dns"})


def _facts(target: Target, state: str, **extra: Any) -> dict[str, Any]:
    return {"breaker": state, "host": target.authority, "destination": target.destination, **extra}


async def permit(breaker: CircuitBreaker, target: Target, route: str) -> Permit:
    """Leave to send to ``target``, or the ``RetryLater`` that parks or defers this delivery."""
    try:
        return await breaker.acquire_checked(target.destination, route=route)
    except CircuitOpen as refused:
        exc = refused
    destination = target.destination
    if breaker.volunteer(destination):
        raise RetryLater(
            f"circuit breaker for {destination} is open; this message tries it in {exc.remaining:.1f}s",
            delay=exc.remaining,
            counts_as_attempt=False,
            detail=_facts(target, "open", retry_in=round(exc.remaining, 3), volunteer=True),
        )
    state = "half-open" if exc.half_open else "open"
    if not breaker.shared:  # nobody could report the recovery: wait out the cool-down
        raise RetryLater(
            f"circuit breaker for {destination} is {state}; not sending",
            delay=exc.remaining,
            counts_as_attempt=False,
            detail=_facts(target, state, retry_in=round(exc.remaining, 3)),
        )
    raise RetryLater(
        f"circuit breaker for {destination} is {state}; parked until it recovers",
        until_recovered=destination,
        delay=PARKED_DELAY,
        detail=_facts(target, state),
    )


def behind_breaker(
    exc: RetryLater, permit: Permit, breaker: CircuitBreaker, target: Target
) -> RetryLater | None:
    """Report a failed request to the breaker; what replaces ``exc`` if the failure only says "unavailable".

    With the breaker open after it, a failed trial's delivery volunteers again
    (it comes back for the next trial, no attempt used), any other is parked like the
    deliveries the breaker turns away. None: ``exc`` stands (a counted retry,
    or the breaker still closed).
    """
    detail = exc.detail or {}
    unavailable = detail.get("status") in UNAVAILABLE_STATUSES or detail.get("reason") in _UNREACHABLE
    pause = COUNTED_TRIAL_PAUSE if permit.trial and not unavailable else None
    open_now = permit.failure(pause=pause)
    if not (open_now and unavailable):
        return None
    destination = target.destination
    if permit.trial or not breaker.shared:
        return RetryLater(
            f"{exc}; the breaker for {destination} stays open; not counted",
            delay=breaker.cooldown,
            counts_as_attempt=False,
            detail={**detail, **_facts(target, "open", trial=permit.trial)},
        )
    return RetryLater(
        f"{exc}; the breaker for {destination} is open: parked until it recovers",
        until_recovered=destination,
        delay=PARKED_DELAY,
        detail={**detail, **_facts(target, "open")},
    )
