"""What a receiver's HTTP answer means for a webhook delivery: delivered, retried (and when), or dead.

The handler (``webhook.WebhookHandler``) sends; this module only reads the
answer. The circuit breaker hears the same verdict through :func:`healthy`.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from outbox import Message, PermanentError, RetryLater

from ._webhook_http import EXCERPT_CHARS, Target, retry_after

__all__ = ["classify", "healthy"]

#: The webhook handler's logger: a 410 Gone is reported there.
log = logging.getLogger("outbox.integrations.webhook")

_RETRYABLE = frozenset({408, 425, 429})


def healthy(status: int) -> bool:
    """Does the answer show the receiver up? A 4xx does (it understood and refused); a 5xx does not."""
    return not (status >= 500 or status in _RETRYABLE)


def classify(
    message: Message,
    target: Target,
    msg_id: str,
    status: int,
    headers: httpx.Headers,
    excerpt: str,
) -> dict[str, Any]:
    """The delivered attempt's detail, or the RetryLater / PermanentError the answer calls for."""
    detail: dict[str, Any] = {"status": status, "host": target.authority, "webhook_id": msg_id}
    if 200 <= status < 300:
        return detail
    detail["response"] = excerpt
    if 300 <= status < 400:
        location = headers.get("location", "")
        detail["location"] = location[:EXCERPT_CHARS]
        raise PermanentError(
            f"HTTP {status} from {target.authority} redirects to {location[:200]!r}; "
            "redirects are refused (SSRF guard): configure the final URL",
            detail=detail,
        )
    if status >= 500 or status in _RETRYABLE:
        raw = headers.get("retry-after")
        delay = retry_after(raw)
        if raw is not None:
            detail["retry_after"] = raw[:100]
        raise RetryLater(f"HTTP {status} from {target.authority}", delay=delay, detail=detail)
    if status == 410:
        detail["gone"] = True
        log.error(
            "%s answered 410 Gone for route %s: the receiver retired this URL; message #%d is dead",
            target.authority,
            message.handler,
            message.id,
            extra={
                "action": "webhook_gone",
                "handler": message.handler,
                "message_id": message.id,
                "destination": target.destination,
            },
        )
        raise PermanentError(f"HTTP 410 Gone from {target.authority}: endpoint retired", detail=detail)
    if 400 <= status < 500:
        raise PermanentError(f"HTTP {status} from {target.authority}", detail=detail)
    raise RetryLater(f"unexpected HTTP status {status} from {target.authority}", detail=detail)
