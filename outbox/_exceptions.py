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
    ├── RetryLater                  raised by a handler: transient, try again (optionally after `delay`)
    └── PermanentError              raised by a handler: will never succeed, mark the message dead

Validation errors are raised before anything is buffered or written, so a caller
can catch them and carry on with the same session and transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ._topics import is_pattern

__all__ = [
    "ConfigurationError",
    "EmitError",
    "InvalidEmitOption",
    "NotInstalled",
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
        #: The wildcard patterns routes subscribe to, none of which matched.
        self.patterns = tuple(name for name in known if is_pattern(name))
        exact = [name for name in known if not is_pattern(name)]
        hint = f" Known event types: {', '.join(exact)}." if exact else ""
        if self.patterns:
            hint += (
                f" Patterns: {', '.join(self.patterns)} ('*' matches one dot-separated word, "
                "'#' zero or more)."
            )
        super().__init__(
            f"no route subscribes to event type {event_type!r}; register one with "
            f"@outbox.handler({event_type!r}) or outbox.route({event_type!r}, ...)."
            f"{hint or ' No routes are registered.'}"
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
    """

    def __init__(
        self,
        message: str = "",
        *,
        delay: float | timedelta | None = None,
        detail: Mapping[str, Any] | None = None,
        counts_as_attempt: bool = True,
    ) -> None:
        super().__init__(message or "handler asked to retry later")
        if isinstance(delay, timedelta):
            delay = delay.total_seconds()
        if delay is not None and not delay >= 0:
            raise ValueError(f"RetryLater delay must be >= 0 seconds, got {delay!r}")
        self.delay: float | None = delay
        self.detail: dict[str, Any] | None = dict(detail) if detail is not None else None
        self.counts_as_attempt = counts_as_attempt


class PermanentError(OutboxError):
    """Raised by a handler when the message can never succeed: it goes dead at once.

    ``detail`` is stored with the attempt, as for :class:`RetryLater`.
    """

    def __init__(self, message: str = "", *, detail: Mapping[str, Any] | None = None) -> None:
        super().__init__(message or "handler reported a permanent failure")
        self.detail: dict[str, Any] | None = dict(detail) if detail is not None else None
