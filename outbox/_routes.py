"""Routes: which handler receives which event type, and with what delivery options."""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ._backoff import Backoff
from ._exceptions import ConfigurationError
from ._topic import is_topic_pattern, topic_pattern_problem, words_match

__all__ = ["Route", "Transform", "Validator", "check_name", "check_plain_callable", "handler_name"]

#: ``transform(event_payload) -> route_payload``: shapes one route's payload at emit time.
Transform = Callable[[dict[str, Any]], Any]
#: ``handler.outbox_validate(route_payload) -> None``: refuses a payload its handler could not deliver.
Validator = Callable[[Any], None]

_NAME_LIMIT = 255
#: The longest expiry a route may set: about ten years, far below where timestamps overflow.
MAX_EXPIRES_AFTER = timedelta(days=3650)
_NAME = re.compile(r"^[^\s\x00-\x1f\x7f]+$")


def check_name(what: str, value: object) -> str:
    """Names end up in indexed columns and log lines: short, printable, no spaces."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{what} must be a non-empty string, got {value!r}")
    if len(value) > _NAME_LIMIT:
        raise ConfigurationError(f"{what} must be at most {_NAME_LIMIT} characters, got {len(value)}")
    if not _NAME.match(value):
        raise ConfigurationError(f"{what} must not contain whitespace or control characters: {value!r}")
    return value


def handler_name(handler: Any) -> str:
    """A default route name that survives restarts: the function's import path.

    Handler objects (a WebhookHandler, say) have no meaningful import path of
    their own, so routes to them must be named explicitly.
    """
    module = getattr(handler, "__module__", None)
    qualname = getattr(handler, "__qualname__", None)
    if callable(handler) and module and qualname and "<" not in qualname:
        return f"{module}.{qualname}"
    raise ConfigurationError(
        f"cannot derive a stable route name for {handler!r}; pass name=... "
        "(the name is stored with every message, so it must not change between deploys)"
    )


@dataclass(frozen=True, slots=True)
class Route:
    """One subscription: messages of ``event_type`` go to ``handler`` under ``name``.

    ``event_type`` may be a pattern (RabbitMQ topic rules: ``*`` one
    dot-separated word, ``#`` zero or more); ``pattern`` says whether it is, and
    :meth:`matches` whether an emitted event type is one of this route's.

    ``name`` is what the ``handler`` column stores and what relays claim by, so
    renaming a route strands its pending messages; keep it stable.

    ``transform`` shapes the payload this route stores from the event's payload
    at emit time; ``validator`` is the handler's ``outbox_validate``, found
    here once so an emit to a route with neither pays nothing for them.

    ``expires_after``: a message of this route not handed to its handler
    within this long of being stored is never handed to it (outcome
    ``expired``, status ``discarded``). None: it never expires.
    """

    event_type: str
    name: str
    handler: Any
    max_attempts: int
    timeout: float
    queue: str
    priority: int
    backoff: Backoff = Backoff()
    transform: Transform | None = None
    expires_after: timedelta | None = None
    validator: Validator | None = field(init=False, repr=False, compare=False)
    pattern: bool = field(init=False, repr=False, compare=False)
    _words: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("event type", self.event_type)
        problem = topic_pattern_problem(self.event_type)
        if problem:
            raise ConfigurationError(f"route {self.name!r}: {problem}")
        object.__setattr__(self, "pattern", is_topic_pattern(self.event_type))
        object.__setattr__(self, "_words", tuple(self.event_type.split(".")))
        check_name("route name", self.name)
        check_name("queue", self.queue)
        if not callable(self.handler):
            raise ConfigurationError(f"route {self.name!r}: handler {self.handler!r} is not callable")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise ConfigurationError(f"route {self.name!r}: max_attempts must be an int")
        if self.max_attempts < 1:
            raise ConfigurationError(
                f"route {self.name!r}: max_attempts must be at least 1, got {self.max_attempts}"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise ConfigurationError(
                f"route {self.name!r}: timeout must be a positive number of seconds, got {self.timeout!r}"
            )
        check_priority(self.priority, f"route {self.name!r}: priority", ConfigurationError)
        if not isinstance(self.backoff, Backoff):
            raise ConfigurationError(
                f"route {self.name!r}: backoff must be an outbox.Backoff, got {self.backoff!r}"
            )
        if self.transform is not None:
            check_plain_callable(self.transform, f"route {self.name!r}: transform")
        if self.expires_after is not None and (
            not isinstance(self.expires_after, timedelta)
            or not timedelta(0) < self.expires_after <= MAX_EXPIRES_AFTER
        ):
            raise ConfigurationError(
                f"route {self.name!r}: expires_after must be a positive timedelta of at most "
                f"{MAX_EXPIRES_AFTER.days} days (or None: never expires), got {self.expires_after!r}"
            )
        validator = getattr(self.handler, "outbox_validate", None)
        if validator is not None:
            check_plain_callable(validator, f"route {self.name!r}: the handler's outbox_validate")
        object.__setattr__(self, "validator", validator)

    def matches(self, event_type: str) -> bool:
        """Is an event of ``event_type`` (a plain event type, never a pattern) one this route takes?"""
        if not self.pattern:
            return event_type == self.event_type
        return words_match(self._words, tuple(event_type.split(".")))


def check_plain_callable(fn: object, what: str) -> None:
    """Emit-time hooks run inside emit(), a plain function: they cannot be awaited there."""
    if not callable(fn):
        raise ConfigurationError(f"{what} must be callable, got {fn!r}")
    if (
        inspect.iscoroutinefunction(fn)
        or inspect.isasyncgenfunction(fn)
        or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004
    ):
        raise ConfigurationError(
            f"{what} must be a plain function, not async: it runs inside emit(), in the request, "
            "where nothing can be awaited"
        )


PRIORITY_RANGE = (-(2**31), 2**31 - 1)


def check_priority(value: object, what: str, error: type[Exception]) -> int:
    low, high = PRIORITY_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{what} must be an int between {low} and {high} (lower runs first), got {value!r}")
    return value
