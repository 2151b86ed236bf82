"""What a JetStream publish's answer means for the message's attempt, for ``NatsPublisher``.

Each message of a batch gets its own: the exception its publish or its ack
wait raised is mapped here to the outcome the publisher's table promises
(delivered, retried, retried uncounted, parked, dead). While the connection
is down, a message is parked on the servers (``_broker_recovery``): nats-py's
reconnect, or the publisher's probe, releases it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from outbox import PermanentError, RetryLater

from ._broker_recovery import Recovery

__all__ = ["CONNECTION_ERRORS", "RECONNECT_WAIT", "Answers", "with_base"]

#: Seconds between reconnection attempts, and before a delivery that found the connection down is retried.
RECONNECT_WAIT = 1.0
#: The connection is down or going down: a publish that fails with these says nothing about the message.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
)


class Answers:
    """The mapping for one publisher: its ack timeout, its stream, its way of masking secrets in text."""

    def __init__(
        self,
        publish_timeout: float,
        stream: str | None,
        text: Callable[[BaseException], str],
        recovery: Recovery,
    ) -> None:
        self.publish_timeout = publish_timeout
        self.stream = stream
        self._text = text
        self._recovery = recovery

    def down(self, why: str, detail: dict[str, Any]) -> RetryLater:
        """The deferral while the connection is down: parked in a relay (the reconnect releases it)."""
        if self._recovery.parks:
            return self._recovery.parked(why, detail)
        return RetryLater(
            f"NATS {why}; not counted", delay=RECONNECT_WAIT, counts_as_attempt=False, detail=detail
        )

    def refusal(self, exc: Exception, client: Client, subject: str, msg_id: str) -> Exception:
        """What one message's attempt ends with, given what its publish or its ack raised."""
        base = {"subject": subject, "msg_id": msg_id}
        if isinstance(exc, TimeoutError):
            if not client.is_connected:  # the connection went down meanwhile: nothing known of the message
                return self.down(
                    f"no JetStream ack for {subject!r}: the connection went down",
                    {**base, "reason": "disconnected"},
                )
            return RetryLater(
                f"no JetStream ack for {subject!r} within {self.publish_timeout:g}s",
                detail={**base, "reason": "ack_timeout"},
            )
        if isinstance(exc, nats.js.errors.APIError):
            detail = {**base, "code": exc.code, "err_code": exc.err_code}
            if exc.code == 400:
                return PermanentError(f"JetStream refused {subject!r}: {exc.description}", detail=detail)
            return RetryLater(f"JetStream error for {subject!r}: {exc.description}", detail=detail)
        if isinstance(exc, nats.errors.MaxPayloadError):
            return PermanentError(
                f"message is larger than the server's max_payload ({client.max_payload} bytes)",
                detail={**base, "reason": "too_large"},
            )
        if isinstance(exc, CONNECTION_ERRORS):
            why = f"publish to {subject!r} failed: {type(exc).__name__}: {self._text(exc)}"
            if not client.is_connected:
                return self.down(why, {**base, "reason": "connection"})
            return RetryLater(
                f"{why}; not counted",
                delay=RECONNECT_WAIT,
                counts_as_attempt=False,
                detail={**base, "reason": "connection"},
            )
        if isinstance(exc, nats.errors.Error):
            return RetryLater(
                f"publish to {subject!r} failed: {type(exc).__name__}: {self._text(exc)}",
                detail={**base, "reason": "error"},
            )
        return exc  # not NATS's answer: the relay records it as the handler's failure

    async def no_stream(self, js: JetStreamContext, subject: str) -> Exception:
        """No responder: no stream captures the subject (dead), or JetStream is not up yet (retried).

        A server that has just restarted accepts connections before it has
        recovered its streams; asking the JetStream API tells the two apart.
        """
        try:
            found = await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            wanted = f" in stream {self.stream!r}" if self.stream else ""
            return PermanentError(
                f"no JetStream stream captures subject {subject!r}{wanted}: create or extend the "
                "stream, then requeue the dead messages",
                detail={"reason": "no_stream"},
            )
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            return RetryLater(
                f"JetStream did not answer for {subject!r} ({type(exc).__name__}); not available yet? "
                "not counted",
                delay=RECONNECT_WAIT,
                counts_as_attempt=False,
                detail={"reason": "jetstream_unavailable"},
            )
        return RetryLater(
            f"stream {found!r} captures {subject!r} but did not answer the publish; recovering? not counted",
            delay=RECONNECT_WAIT,
            counts_as_attempt=False,
            detail={"reason": "jetstream_unavailable"},
        )


def with_base(found: Exception, base: dict[str, Any]) -> Exception:
    """One message's copy of what a subject's stream lookup found, its subject and msg_id in the detail."""
    detail = {**base, **(getattr(found, "detail", None) or {})}
    if isinstance(found, RetryLater):
        return RetryLater(
            str(found), delay=found.delay, counts_as_attempt=found.counts_as_attempt, detail=detail
        )
    return PermanentError(str(found), detail=detail)
