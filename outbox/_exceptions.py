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
    ├── PermanentError              raised by a handler: will never succeed, mark the message dead
    └── InboxError                  the inbox could not take one incoming message as it was given
        ├── InvalidInboxMessage     a message id, event type or time the inbox cannot store
        ├── MessageTooOld           sent longer ago than the inbox keeps markers: refused, not re-applied
        ├── HandlerFailed           an inbox handler raised: marker and effects rolled back together
        ├── NoInboxHandler          no handler of the inbox matches the event type (a dead letter's error)
        └── AckFailed               the message's outcome is committed; acknowledging it to its source failed

Validation errors are raised before anything is buffered or written, so a caller
can catch them and carry on with the same session and transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ._first_line import first_line

if TYPE_CHECKING:  # a module of plain data that imports nothing from the package
    from ._inbox.message import InboxMessage, Processed

from ._topic import is_topic_pattern

#: How long a parked message waits at most when no recovery is reported (``RetryLater(until_recovered=)``).
PARKED_DELAY = 60.0
#: The longest destination a message can be parked on (``outbox_message.parked_on``'s limit).
DESTINATION_LIMIT = 1000

__all__ = [
    "AckFailed",
    "ConfigurationError",
    "EmitError",
    "HandlerFailed",
    "InboxError",
    "InvalidInboxMessage",
    "MessageTooOld",
    "NoInboxHandler",
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
        #: The wildcard patterns routes subscribe to, none of which matched.
        self.patterns = tuple(name for name in known if is_topic_pattern(name))
        exact = [name for name in known if not is_topic_pattern(name)]
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


class InboxError(OutboxError):
    """The inbox could not take one incoming message as it was given (see the subclasses)."""


class InvalidInboxMessage(InboxError, ValueError):
    """A message id, event type, source or time the inbox cannot store; nothing was written."""


class MessageTooOld(InboxError):
    """The message was sent longer ago than the inbox keeps its markers.

    Its marker, if it was ever received, may already be purged, so the inbox
    can no longer tell a duplicate from a first delivery: it refuses the
    message instead of risking its effects twice. ``Inbox.process`` records
    it as a dead letter, where an operator decides.
    """

    def __init__(
        self, inbox: str, message_id: str, sent_at: datetime, keep: timedelta, now: datetime
    ) -> None:
        self.inbox = inbox
        self.message_id = message_id
        self.sent_at = sent_at
        self.keep = keep
        super().__init__(
            f"inbox {inbox!r} refuses message {message_id!r}: sent at {sent_at.isoformat()}, "
            f"{now - sent_at} ago, longer than the {keep} it keeps markers for, so a duplicate "
            "could no longer be told apart; raise the inbox's keep= if such late deliveries are expected"
        )


class HandlerFailed(InboxError):
    """An inbox handler raised (or its changes could not be flushed); nothing of the message was stored.

    The marker and every effect were rolled back together, so a redelivery
    runs the handlers again. ``message`` is what was processed (its
    ``attempt`` says how many times the source has delivered it),
    ``handler`` the name of the handler that raised (None when flushing the
    handlers' changes failed), and ``__cause__`` the original error.
    """

    def __init__(self, message: InboxMessage, handler: str | None, error: BaseException) -> None:
        self.message = message
        self.handler = handler
        self.error = error
        where = f"handler {handler!r}" if handler else "writing the handlers' changes"
        super().__init__(
            f"message {message.id!r} ({message.event_type}, attempt {message.attempt}): {where} failed: "
            f"{type(error).__name__}: {first_line(error)}"
        )


class NoInboxHandler(InboxError):
    """No handler of the inbox matches the message's event type: recorded as a dead letter, not dropped."""

    def __init__(self, inbox: str, event_type: str, known: tuple[str, ...]) -> None:
        self.event_type = event_type
        patterns = ", ".join(known) if known else "none"
        super().__init__(
            f"inbox {inbox!r} has no handler for event type {event_type!r} (its handlers: {patterns}); "
            f"register one with @inbox.handler({event_type!r}), or pass unhandled='skip' to the Inbox"
        )


class AckFailed(InboxError):
    """The message's outcome is committed, but the source's acknowledgement raised.

    Nothing is lost: the source delivers the message again and the inbox
    answers it as a duplicate. ``result`` is what was committed; ``__cause__``
    is the acknowledgement's error.
    """

    def __init__(self, result: Processed, error: BaseException) -> None:
        self.result = result
        super().__init__(
            f"message {result.message_id!r} is {result.outcome} and committed, but acknowledging it failed: "
            f"{type(error).__name__}: {first_line(error)}; its redelivery will be answered as a duplicate"
        )
