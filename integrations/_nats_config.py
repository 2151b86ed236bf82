"""The NATS publisher's settings checked where the route is defined: servers, subjects, streams, options.

A bad setting fails when the publisher is built (``ConfigurationError``), not at
the first message after a deploy; a server URL is never quoted, since it may
carry a password.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from outbox import ConfigurationError

__all__ = ["BAD_STREAM", "BAD_SUBJECT", "RESERVED_OPTIONS", "SECRET_OPTIONS", "STATIC", "check_servers"]

SCHEMES = ("nats", "tls", "ws", "wss")
RESERVED_OPTIONS = frozenset(
    {"servers", "allow_reconnect", "max_reconnect_attempts", "error_cb", "disconnected_cb", "reconnected_cb"}
)
SECRET_OPTIONS = ("password", "token", "nkeys_seed_str")
BAD_SUBJECT = re.compile(r"[\s*>]|^\.|\.\.|\.$")
BAD_STREAM = re.compile(r"[\s.*>/\\]")
STATIC = {"event_type", "handler"}  # template fields a route fixes, so its subject is known at start


def check_servers(servers: object) -> list[str]:
    listed = [servers] if isinstance(servers, str) else servers
    if not isinstance(listed, list | tuple) or not listed:
        raise ConfigurationError("servers must be a NATS URL or a non-empty list of them")
    for url in listed:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in SCHEMES or not parts.hostname:
            # Never the URL itself in the error: it may carry a password.
            raise ConfigurationError(
                "NATS servers must be URLs like nats://host:4222 (schemes: " + ", ".join(SCHEMES) + ")"
            )
    return [str(url) for url in listed]
