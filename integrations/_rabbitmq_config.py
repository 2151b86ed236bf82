"""What the RabbitMQ publisher and consumer check alike when they are built: the URL, seconds, secrets.

Both are given a broker URL that may carry a password; both must refuse a
bad one before any network call, and neither may ever show the password.
Kept apart from either so that the consumer's module does not import the
publisher's (which re-exports the consumer).
"""

from __future__ import annotations

import math

from yarl import URL

from outbox import ConfigurationError

__all__ = ["check_url", "positive", "secrets", "shown"]


def check_url(url: object) -> URL:
    """The parsed ``amqp://`` or ``amqps://`` URL; a one-line ConfigurationError otherwise."""
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"the RabbitMQ URL must be a non-empty string, got {type(url).__name__}")
    try:
        parsed = URL(url)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"invalid RabbitMQ URL: {exc}") from None
    if parsed.scheme not in ("amqp", "amqps"):
        raise ConfigurationError(f"RabbitMQ URLs must be amqp:// or amqps://, got {shown(parsed)!r}")
    if not parsed.host:
        raise ConfigurationError("the RabbitMQ URL has no host")
    return parsed


def positive(what: str, value: object) -> float:
    """``value`` as seconds, refused unless a finite number above zero."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def shown(url: URL) -> str:
    """The URL as errors, logs and ``repr`` show it: the password masked."""
    return str(url.with_password("***")) if url.password else str(url)


def secrets(raw: str, url: URL) -> list[str]:
    """What must never be shown: the URL as given, and its password decoded and as written."""
    found = [raw] if url.password else []
    for value in (url.password, url.raw_password):
        if value:
            found.append(value)
    return found
