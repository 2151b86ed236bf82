"""NATS settings checked where they are written: servers, subjects, streams, options, their secrets.

Shared by the publisher and the consumer. A bad setting fails when the
publisher or consumer is built (``ConfigurationError``), not at the first
message after a deploy; a server URL is never quoted, since it may carry a
password.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from outbox import ConfigurationError

__all__ = [
    "BAD_STREAM",
    "BAD_SUBJECT",
    "RESERVED_OPTIONS",
    "SECRET_OPTIONS",
    "STATIC",
    "check_servers",
    "hosts",
    "secrets",
]

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


def hosts(servers: list[str]) -> str:
    """``host:port,...``: how logs and names refer to the servers, never with a credential."""
    return ",".join(f"{urlsplit(u).hostname}:{urlsplit(u).port or 4222}" for u in servers)


def secrets(servers: list[str], options: Mapping[str, Any]) -> list[str]:
    """Passwords and tokens from the server URLs and the connect options: masked wherever written."""
    found = []
    for url in servers:
        parts = urlsplit(url)
        for value in (parts.password, parts.username if parts.password is None else None):
            if value:  # a lone user part is a token (nats://token@host)
                found += [value, unquote(value)]
    found += [str(options[k]) for k in SECRET_OPTIONS if isinstance(options.get(k), str)]
    return [s for s in found if s]
