"""Standard Webhooks signatures (https://www.standardwebhooks.com/): sign, verify, make secrets.

A secret is ``whsec_`` followed by base64 of the key bytes. The signed content
is ``{webhook-id}.{webhook-timestamp}.{body}``; the ``webhook-signature``
header carries one space-separated ``v1,<base64 HMAC-SHA256>`` per secret, so
a receiver that knows any one of them (old or new, during a rotation) accepts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets as _random
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from outbox import ConfigurationError, OutboxError

__all__ = [
    "SECRET_PREFIX",
    "WebhookVerificationError",
    "generate_secret",
    "parse_secrets",
    "sign",
    "verify",
]

SECRET_PREFIX = "whsec_"
MIN_KEY_BYTES = 16  # the specification recommends 24 to 64 random bytes
#: Twelve digits reach the year 33658; longer "timestamps" are refused before any arithmetic.
_MAX_TIMESTAMP_DIGITS = 12


class WebhookVerificationError(OutboxError):
    """A received webhook's signature headers are missing, malformed, stale or do not match."""


def generate_secret(nbytes: int = 32) -> str:
    """A fresh ``whsec_...`` secret of ``nbytes`` random bytes."""
    if nbytes < MIN_KEY_BYTES:
        raise ConfigurationError(f"a webhook secret needs at least {MIN_KEY_BYTES} random bytes")
    return SECRET_PREFIX + base64.b64encode(_random.token_bytes(nbytes)).decode("ascii")


def _key(secret: object, position: int, count: int) -> bytes:
    # Messages name the secret by position, never by value: they end up in logs and tracebacks.
    which = "the webhook secret" if count == 1 else f"webhook secret #{position}"
    if not isinstance(secret, str):
        raise ConfigurationError(
            f"{which} must be a string like 'whsec_<base64>', got a {type(secret).__name__}"
        )
    if not secret.startswith(SECRET_PREFIX):
        raise ConfigurationError(f"{which} must start with {SECRET_PREFIX!r} followed by base64 key bytes")
    encoded = secret[len(SECRET_PREFIX) :]
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigurationError(
            f"{which} is not valid base64 after {SECRET_PREFIX!r}; generate one with "
            "outbox.integrations.webhook.generate_secret()"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigurationError(
            f"{which} decodes to {len(key)} bytes; use at least {MIN_KEY_BYTES} "
            "(24 to 64 recommended), e.g. from generate_secret()"
        )
    return key


def parse_secrets(secret: str | Sequence[str]) -> list[bytes]:
    """The key bytes of one ``whsec_`` secret or of each in a list (for rotation)."""
    listed: Sequence[object] = [secret] if isinstance(secret, str) else secret
    if isinstance(listed, bytes | bytearray) or not isinstance(listed, Sequence):
        raise ConfigurationError("secret must be a 'whsec_...' string or a list of them")
    if not listed:
        raise ConfigurationError("secret must name at least one 'whsec_...' secret")
    return [_key(s, i, len(listed)) for i, s in enumerate(listed, 1)]


def _signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return hmac.new(key, signed, hashlib.sha256).digest()


def sign(keys: Iterable[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: one ``v1,`` entry per key."""
    return " ".join(
        "v1," + base64.b64encode(_signature(k, msg_id, str(timestamp), body)).decode("ascii") for k in keys
    )


class SupportsItems(Protocol):
    """Anything header-like with ``items()``: a dict, Starlette/Django/Flask headers, ``http.server``'s."""

    def items(self) -> Iterable[tuple[str, Any]]: ...


def _lowered(headers: SupportsItems | Iterable[tuple[str, str]]) -> dict[str, str]:
    # Duck-typed: email.message.Message (http.server) and werkzeug's headers are not Mappings.
    items = headers.items() if hasattr(headers, "items") else headers
    try:
        return {str(k).lower(): str(v) for k, v in items}
    except (TypeError, ValueError):
        raise TypeError("headers must be a mapping or an iterable of (name, value) pairs") from None


def verify(
    payload: bytes | str,
    headers: SupportsItems | Iterable[tuple[str, str]],
    secret: str | Sequence[str],
    *,
    tolerance: float = 300,
) -> None:
    """Check a received webhook; raise :class:`WebhookVerificationError` unless it is authentic.

    ``payload`` is the raw request body exactly as received (verify before
    parsing JSON: re-serialising changes the bytes). ``headers`` is anything
    with ``items()`` (a dict, a web framework's or ``http.server``'s headers) or
    a list of pairs; names are compared case-insensitively. ``secret`` is one ``whsec_...`` secret
    or several: a signature made with any of them is accepted, which is how a
    receiver rotates. A timestamp more than ``tolerance`` seconds away from now,
    in either direction, is refused, so a captured request cannot be replayed
    later.
    """
    keys = parse_secrets(secret)
    try:
        body = payload.encode() if isinstance(payload, str) else bytes(payload)
    except UnicodeEncodeError:  # a str body with a lone surrogate: no sender signed that
        raise WebhookVerificationError("the body is not valid UTF-8 text") from None
    found = _lowered(headers)
    msg_id = found.get("webhook-id", "")
    stamp = found.get("webhook-timestamp", "").strip()
    offered = found.get("webhook-signature", "")
    missing = [
        n
        for n, v in (("webhook-id", msg_id), ("webhook-timestamp", stamp), ("webhook-signature", offered))
        if not v
    ]
    if missing:
        raise WebhookVerificationError(f"missing header(s): {', '.join(missing)}")
    # ASCII digits only ("²".isdigit() is true), and few enough for int() and float arithmetic.
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > _MAX_TIMESTAMP_DIGITS:
        raise WebhookVerificationError(f"webhook-timestamp is not a Unix time in seconds: {stamp[:40]!r}")
    skew = time.time() - int(stamp)
    if skew > tolerance:
        raise WebhookVerificationError(f"webhook-timestamp is {skew:.0f}s old (tolerance {tolerance:g}s)")
    if -skew > tolerance:
        raise WebhookVerificationError(
            f"webhook-timestamp is {-skew:.0f}s in the future (tolerance {tolerance:g}s)"
        )
    candidates: list[bytes] = []
    for entry in offered.split():
        version, _, encoded = entry.partition(",")
        if version != "v1":
            continue
        try:
            candidates.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    if not candidates:
        raise WebhookVerificationError("webhook-signature has no v1 signature")
    try:
        msg_id.encode()
    except UnicodeEncodeError:
        raise WebhookVerificationError("webhook-id is not valid UTF-8 text") from None
    for key in keys:
        expected = _signature(key, msg_id, stamp, body)
        if any(hmac.compare_digest(expected, candidate) for candidate in candidates):
            return
    raise WebhookVerificationError("no signature matches the secret(s): wrong secret or altered body")
