"""What every step of the inbox reads: its name, window, failure limit and handlers."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from .._exceptions import ConfigurationError, MessageTooOld, NoInboxHandler
from .._routes import check_name
from .handlers import HandlerRegistry

__all__ = ["DEFAULT_KEEP", "DEFAULT_MAX_FAILURES", "MAX_KEEP", "InboxSettings", "Unhandled"]

DEFAULT_KEEP: Final = timedelta(days=7)
#: About ten years: far below where timestamps overflow.
MAX_KEEP: Final = timedelta(days=3650)
DEFAULT_MAX_FAILURES: Final = 5
Unhandled = Literal["dead_letter", "skip"]
_UNHANDLED: Final = ("dead_letter", "skip")


@dataclass(slots=True)
class InboxSettings:
    name: str
    keep: timedelta
    max_failures: int | None
    unhandled: Unhandled
    handlers: HandlerRegistry = field(default_factory=HandlerRegistry)

    def __post_init__(self) -> None:
        check_name("an inbox name", self.name)
        name = self.name
        if not isinstance(self.keep, timedelta) or not timedelta(0) < self.keep <= MAX_KEEP:
            raise ConfigurationError(
                f"inbox {name!r}: keep must be a positive timedelta of at most {MAX_KEEP.days} days, "
                f"got {self.keep!r}"
            )
        limit = self.max_failures
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigurationError(
                f"inbox {name!r}: max_failures must be an int of at least 1, or None, got {limit!r}"
            )
        if self.unhandled not in _UNHANDLED:
            raise ConfigurationError(
                f"inbox {name!r}: unhandled must be 'dead_letter' or 'skip', got {self.unhandled!r}"
            )

    def too_old(self, message_id: str, sent_at: datetime | None) -> MessageTooOld | None:
        """The refusal of a message sent longer ago than ``keep`` (by this host's clock), or None."""
        if sent_at is None:
            return None
        now = datetime.now(UTC)
        if now - sent_at <= self.keep:
            return None
        return MessageTooOld(self.name, message_id, sent_at, self.keep, now)

    def no_handler(self, event_type: str) -> NoInboxHandler:
        return NoInboxHandler(self.name, event_type, self.handlers.patterns)
