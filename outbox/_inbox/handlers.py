"""``@inbox.handler(pattern)``: which functions an incoming event type reaches, in registration order."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._exceptions import ConfigurationError
from .._routes import check_name, handler_name
from .._topic import TopicPattern

__all__ = ["HandlerRegistry", "InboxHandler"]


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


@dataclass(frozen=True, slots=True)
class InboxHandler:
    """One subscription of an inbox: messages whose event type matches ``pattern`` go to ``fn``.

    ``fn(session, message)`` runs inside the transaction that writes the
    message's marker. ``name`` appears in logs, errors and dead letters.
    """

    pattern: str
    name: str
    fn: Callable[..., Any]
    is_async: bool = field(init=False)
    _topic: TopicPattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_name("an inbox handler's event type", self.pattern)
        try:
            object.__setattr__(self, "_topic", TopicPattern(self.pattern))
        except ValueError as exc:
            raise ConfigurationError(f"inbox handler {self.name!r}: {exc}") from None
        if not callable(self.fn):
            raise ConfigurationError(f"inbox handler {self.name!r}: {self.fn!r} is not callable")
        object.__setattr__(self, "is_async", _is_async(self.fn))

    def matches(self, event_type: str) -> bool:
        return self._topic.matches(event_type)


class HandlerRegistry:
    """An inbox's handlers, and for each event type seen the ones it reaches (kept, as types repeat)."""

    def __init__(self) -> None:
        self._handlers: list[InboxHandler] = []
        self._for_type: dict[str, tuple[InboxHandler, ...]] = {}

    def add(self, pattern: str, fn: Callable[..., Any], name: str | None) -> InboxHandler:
        chosen = check_name("an inbox handler's name", name) if name is not None else handler_name(fn)
        if any(h.name == chosen for h in self._handlers):
            raise ConfigurationError(
                f"the inbox has a handler named {chosen!r} already; give this one another name=..."
            )
        handler = InboxHandler(pattern, chosen, fn)
        self._handlers.append(handler)
        self._for_type.clear()
        return handler

    def matching(self, event_type: str) -> tuple[InboxHandler, ...]:
        found = self._for_type.get(event_type)
        if found is None:
            found = tuple(h for h in self._handlers if h.matches(event_type))
            if len(self._for_type) < 10_000:  # event types come from outside: keep the memo bounded
                self._for_type[event_type] = found
        return found

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.pattern for h in self._handlers))

    @property
    def all(self) -> tuple[InboxHandler, ...]:
        return tuple(self._handlers)
