"""The duplicate-window check of ``NatsPublisher``: does the stream still drop a late retry's copy?

A publish JetStream stored but the relay never recorded (it crashed, or the
ack was lost) is published again by the retry. JetStream drops that copy only
if it arrives within the stream's ``duplicate_window`` of the first; the relay
tells its handlers, at start, how late a retry can come (``longest_retry_gap``,
see ``outbox.relay.hooks``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext

__all__ = ["WindowCheck", "check_window"]

log = logging.getLogger("outbox.integrations.nats")


@dataclass(frozen=True, slots=True)
class WindowCheck:
    route: str
    gap: float  # seconds: the route's longest retry gap
    subject: str | None  # the route's subject if every message shares it


async def check_window(
    js: JetStreamContext, check: WindowCheck, *, stream: str | None, subject: str
) -> str | None:
    """Why the window is too short (or the stream missing); None if it covers the gap or cannot be known."""
    if stream is None and check.subject is not None:
        try:
            stream = await js.find_stream_name_by_subject(check.subject)
        except nats.js.errors.NotFoundError:
            return f"no JetStream stream captures subject {check.subject!r}"
    if stream is None:
        log.warning(
            "route %s: subject %r varies per message; pass stream=... to check its duplicate window",
            check.route,
            subject,
            extra={"action": "nats_window_unchecked", "handler": check.route},
        )
        return None
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return f"JetStream stream {stream!r} does not exist"
    window = float(info.config.duplicate_window or 0)
    if window < check.gap:
        return (
            f"stream {stream!r} drops duplicates for {window:g}s, but a retry of route {check.route!r} "
            f"can come {check.gap:g}s after an unrecorded publish (lease, recovery, backoff ceiling, "
            "poll): a retry that late is stored twice. Raise the stream's duplicate_window or lower "
            "the route's backoff cap or max_attempts"
        )
    log.info(
        "route %s: stream %r duplicate window %gs covers the longest retry gap %gs",
        check.route,
        stream,
        window,
        check.gap,
        extra={"action": "nats_window_ok", "handler": check.route, "stream": stream},
    )
    return None
