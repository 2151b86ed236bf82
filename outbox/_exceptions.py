"""Every error the outbox raises on purpose.

The tree, so ``except`` clauses can be as wide or as narrow as a caller needs::

    OutboxError                     root of everything below
    ├── ConfigurationError          bad settings, a bad route, an unsupported install target
    │   └── NotInstalled            emit() on a session whose factory no Outbox was installed on
    ├── EmitError                   emit() refused the event; the caller's transaction is untouched
    │   ├── UnroutedEvent           no route subscribes to the event type
    │   ├── PayloadError            payload not JSON-serialisable, not an object, too large, nested too
    │   │                           deeply, or a route's transform or handler refused it
    │   └── InvalidEmitOption       a bad option: negative delay, empty key, bad headers, ...
    ├── RetryLater                  raised by a handler: transient, try again (optionally after `delay`);
    │                               with `until_recovered`, parked until its destination is back
    └── PermanentError              raised by a handler: will never succeed, mark the message dead

Validation errors are raised before anything is buffered or written, so a caller
can catch them and carry on with the same session and transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

#: How long a parked message waits at most when no recovery is reported (``RetryLater(until_recovered=)``).
PARKED_DELAY = 60.0
#: The longest destination a message can be parked on (``outbox_message.parked_on``'s limit).
DESTINATION_LIMIT = 1000

__all__ = [
    "ConfigurationError",
    "EmitError",
    "InvalidEmitOption",
    "NotInstalled",
    "PARKED_DELAY",
    "OutboxError",
    "PayloadError",
    "PermanentError",
    "RetryLater",
    "UnroutedEvent",
]


class OutboxError(Exception):
    """Root of every error sqlalchemy-outbox raises on purpose."""


class ConfigurationError(OutboxError):
    """The outbox was set up wrongly; raised at set-up time, not at delivery time."""


class NotInstalled(ConfigurationError):
    """emit() was called on a session that no ``Outbox`` serves."""


class EmitError(OutboxError):
    """emit() refused an event; nothing was buffered and the transaction is still usable."""


class UnroutedEvent(EmitError):
    """No route subscribes to the event type, so storing it would lose it silently."""

    def __init__(self, event_type: str, known: tuple[str, ...] = ()) -> None:
        self.event_type = event_type
        hint = f" Known event types: {', '.join(known)}." if known else " No routes are registered."
        super().__init__(
            f"no route subscribes to event type {event_type!r}; register one with "
            f"@outbox.handler({event_type!r}) or outbox.route({event_type!r}, ...).{hint}"
        )


class PayloadError(EmitError):
    """The payload cannot be stored: not a JSON object, not serialisable, too large or too deep.

    The limits are ``Outbox(payload_limit=...)`` bytes of JSON and
    ``Outbox(payload_depth_limit=...)`` levels of nesting.

    Also raised when a route's ``transform`` fails or returns such a payload, or
    its handler's ``outbox_validate`` refuses the route's payload; the message
    then names the route, and the original error is the ``__cause__``.
    """


class InvalidEmitOption(EmitError, ValueError):
    """An emit() option has a value the outbox cannot honour."""


class RetryLater(OutboxError):
    """Raised by a handler for a transient failure: the relay retries the message.

    ``delay`` overrides the route's backoff for this one retry (a webhook's
    ``Retry-After``, say). ``detail`` (a JSON-able mapping: HTTP status, SMTP
    code) is stored with the attempt, secrets masked. The attempt counts towards
    ``max_attempts`` unless ``counts_as_attempt=False``: for deferrals that say
    nothing about the message itself, such as an open circuit breaker or a rate
    limit, which must not use up a message's attempts during a long outage.

    ``until_recovered`` names the destination that is unavailable (a broker's
    URL without credentials, a webhook's ``host:port``): the message is
    *parked* on it (``outbox_message.parked_on``) and becomes due again the
    moment the relay learns the destination is back (a reconnect, a successful
    trial request, ``outbox breaker reset``), for every message parked on it
    at once; ``delay`` (default :data:`PARKED_DELAY`, a minute) is then only
    the longest wait should that news never come. A parked deferral never
    counts as an attempt: an unavailable destination says nothing about the
    message. Only a handler that can also report the recovery should park
    (the broker publishers and the webhook handler do, through the relay's
    ``outbox_share_breakers`` hook); any other waits its whole ``delay``.
    """

    def __init__(
        self,
        message: str = "",
        *,
        delay: float | timedelta | None = None,
        detail: Mapping[str, Any] | None = None,
        counts_as_attempt: bool | None = None,
        until_recovered: str | None = None,
    ) -> None:
        super().__init__(message or "handler asked to retry later")
        if isinstance(delay, timedelta):
            delay = delay.total_seconds()
        if delay is not None and not delay >= 0:
            raise ValueError(f"RetryLater delay must be >= 0 seconds, got {delay!r}")
        if until_recovered is not None:
            if not isinstance(until_recovered, str) or not until_recovered.strip():
                raise ValueError("RetryLater until_recovered must name a destination (a non-empty string)")
            if len(until_recovered) > DESTINATION_LIMIT:
                raise ValueError(
                    f"RetryLater until_recovered is at most {DESTINATION_LIMIT} characters, "
                    f"not {len(until_recovered)}"
                )
            if counts_as_attempt:
                raise ValueError(
                    "RetryLater(until_recovered=...) never counts as an attempt: the destination is "
                    "unavailable, which says nothing about the message"
                )
            if delay is None:
                delay = PARKED_DELAY
        self.delay: float | None = delay
        self.detail: dict[str, Any] | None = dict(detail) if detail is not None else None
        if counts_as_attempt is None:
            counts_as_attempt = until_recovered is None
        self.counts_as_attempt: bool = counts_as_attempt
        self.until_recovered: str | None = until_recovered


class PermanentError(OutboxError):
    """Raised by a handler when the message can never succeed: it goes dead at once.

    ``detail`` is stored with the attempt, as for :class:`RetryLater`.
    """

    def __init__(self, message: str = "", *, detail: Mapping[str, Any] | None = None) -> None:
        super().__init__(message or "handler reported a permanent failure")
        self.detail: dict[str, Any] | None = dict(detail) if detail is not None else None
