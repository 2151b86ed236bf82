"""Publish to NATS JetStream: the CloudEvents envelope, acked publishes, the broker's dedupe window.

::

    from outbox.integrations.nats import NatsPublisher

    ob.route(
        "order.paid",
        NatsPublisher("nats://127.0.0.1:4222", subject="orders.{event_type}", stream="ORDERS"),
        name="orders_nats",
    )

Each message is published with ``Nats-Msg-Id`` set to the envelope's dedupe id
(event id and route, kept by retries and requeued copies), so JetStream drops
a second copy that arrives inside the stream's duplicate window. A publish
counts only once JetStream acknowledged it; an ack flagged ``duplicate``
counts as delivered too (the first copy is stored), recorded as
``duplicate: true`` with the stream and sequence.

=====================================  ==============================================================
acked (stored, or a duplicate)         delivered; detail: subject, stream, seq, duplicate, msg_id
no ack within ``publish_timeout``      retried (the server may have stored it: the retry is deduped);
                                       not counted when the connection went down meanwhile
connection down, reconnecting, lost    parked until the connection is back, without waiting for a
mid-publish                            timeout, and not counted (nothing is known of the message)
no stream captures the subject         dead with the reason (a stream is configuration: create it,
                                       then requeue); a JetStream that does not answer yet (a
                                       restarting server) is retried, not counted
JetStream refuses it (400: expected    dead with the server's description
stream mismatch, message too large)
other JetStream errors (503, limits)   retried
=====================================  ==============================================================

While the connection is down (nats-py reconnects on its own, once a second) or
was never made, a message is parked on the servers
(``_broker_recovery``, keyed ``nats://host:port,...``): the reconnect, or the
first success of a probe when the relay started during the outage, sends
every message parked on them at once, in every relay.

Before the relay claims anything, ``outbox_start`` compares the stream's
``duplicate_window`` with the route's longest retry gap (see
``outbox.relay.hooks``): a retry that comes later than the window is stored
twice. ``on_short_window="warn"`` logs ``nats_window_short``; ``"refuse"``
raises ``ConfigurationError`` so the relay does not start.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from outbox import ConfigurationError, Message, PermanentError, RetryLater, Route
from outbox._redact import Redactor

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

from ._broker_recovery import Probe, Recovery
from ._envelope import RoutingTemplate, envelope
from ._nats_config import BAD_STREAM, BAD_SUBJECT, RESERVED_OPTIONS, SECRET_OPTIONS, STATIC, check_servers
from ._nats_window import WindowCheck, check_window, no_stream
from ._per_loop import PerLoop

__all__ = ["NatsPublisher"]

log = logging.getLogger("outbox.integrations.nats")

#: How long a route whose window check failed under ``on_short_window="refuse"`` waits between tries.
BLOCKED_RETRY = 60.0
#: Seconds between reconnection attempts, and before a delivery that found the connection down is retried.
RECONNECT_WAIT = 1.0
#: The connection is down or going down: a publish that fails with these says nothing about the message.
_CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
)


@dataclass(slots=True)
class _Link:
    """The connection of one event loop (the relay's): opened at first use, closed at shutdown."""

    client: Client | None = None
    js: JetStreamContext | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one connect at a time
    check_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one deferred window check
    probe: Probe = field(default_factory=Probe)  # the first connect, retried while the servers are away


class NatsPublisher:
    """Publish each message to JetStream on ``subject`` (a template), acked, deduplicated by ``Nats-Msg-Id``.

    ``servers`` is one ``nats://`` URL or several (credentials in the URL are
    masked in logs and history). ``stream`` names the stream the subject must
    land in (sent as ``Nats-Expected-Stream``, and the stream whose window is
    checked); without it the stream is looked up by the route's subject.
    ``connect_options`` go to ``nats.connect`` (``tls``, ``user_credentials``,
    ``token``...); reconnection is always on and never gives up.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        subject: str = "{event_type}",
        stream: str | None = None,
        *,
        source: str = "urn:sqlalchemy-outbox:{handler}",
        publish_timeout: float = 5.0,
        on_short_window: Literal["warn", "refuse"] = "warn",
        connect_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.servers = check_servers(servers)
        self._subject = RoutingTemplate(subject, "NATS subject")
        self.subject = subject
        if BAD_SUBJECT.search(subject.format(**dict.fromkeys(self._subject.fields, "x"))):
            raise ConfigurationError(f"NATS subject {subject!r}: no spaces, wildcards or empty tokens")
        if stream is not None and (not isinstance(stream, str) or not stream or BAD_STREAM.search(stream)):
            raise ConfigurationError(f"stream must be a JetStream stream name, got {stream!r}")
        self.stream = stream
        if not isinstance(source, str) or not source:
            raise ConfigurationError("source must be a non-empty string")
        self.source = source
        if (
            isinstance(publish_timeout, bool)
            or not isinstance(publish_timeout, int | float)
            or not math.isfinite(publish_timeout)
            or publish_timeout <= 0
        ):
            raise ConfigurationError(f"publish_timeout must be a positive number, got {publish_timeout!r}")
        self.publish_timeout = float(publish_timeout)
        if on_short_window not in ("warn", "refuse"):
            raise ConfigurationError(f"on_short_window must be 'warn' or 'refuse', got {on_short_window!r}")
        if on_short_window == "refuse" and stream is None and not set(self._subject.fields) <= STATIC:
            raise ConfigurationError(
                f"on_short_window='refuse' needs stream=...: subject {subject!r} varies per message, "
                "so the stream whose duplicate window matters is not known at start"
            )
        self.on_short_window = on_short_window
        options = dict(connect_options or {})
        reserved = sorted(RESERVED_OPTIONS & set(options))
        if reserved:
            raise ConfigurationError(f"connect_options may not set {', '.join(reserved)}: NatsPublisher does")
        self._options = options
        self._redactor = Redactor(self.outbox_secrets())
        self._links: PerLoop[_Link] = PerLoop(_Link)
        self._deferred: dict[str, WindowCheck] = {}  # window checks NATS was not reachable for at start
        self._blocked: dict[str, str] = {}  # route -> why it may not publish ("refuse", found late)
        hosts = ",".join(f"{urlsplit(u).hostname}:{urlsplit(u).port or 4222}" for u in self.servers)
        self._recovery = Recovery(f"nats://{hosts}", f"NATS at {hosts}")

    @property
    def destination(self) -> str:
        """What a message is parked on while the servers are away: their addresses, never a credential."""
        return self._recovery.destination

    def __repr__(self) -> str:
        hosts = ",".join(f"{urlsplit(u).hostname}:{urlsplit(u).port or 4222}" for u in self.servers)
        return f"<NatsPublisher {hosts} subject={self.subject!r} stream={self.stream!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """Passwords and tokens from the server URLs and ``connect_options``: masked wherever written."""
        found = []
        for url in self.servers:
            parts = urlsplit(url)
            for value in (parts.password, parts.username if parts.password is None else None):
                if value:  # a lone user part is a token (nats://token@host)
                    found += [value, unquote(value)]
        found += [str(self._options[k]) for k in SECRET_OPTIONS if isinstance(self._options.get(k), str)]
        return [s for s in found if s]

    async def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
        """Compare the stream's duplicate window with the route's longest retry gap, once, at start."""
        check = WindowCheck(route.name, longest_retry_gap, self._route_subject(route))
        try:
            await self._check_window(check, at_start=True)
        except (OSError, TimeoutError, nats.errors.Error, RetryLater) as exc:
            self._deferred[route.name] = check
            log.warning(
                "route %s: NATS not reachable at start (%s); duplicate window checked at the first publish",
                route.name,
                self._text(exc),
                extra={"action": "nats_window_deferred", "handler": route.name},
            )

    def outbox_share_breakers(self, board: BreakerBoard) -> None:
        """The relay's board: how a reconnect releases the messages parked on the servers, in every relay."""
        self._recovery.share(board)

    async def outbox_shutdown(self) -> None:
        """Close the running loop's connection (every publish was awaited to its ack: nothing to drain)."""
        link = self._links.pop(asyncio.get_running_loop())
        if link is not None:
            await link.probe.stop()
            if link.client is not None and not link.client.is_closed:
                await link.client.close()

    # -- delivery -----------------------------------------------------------------------

    async def __call__(self, message: Message) -> dict[str, Any]:
        subject = self._subject.render(message)
        if BAD_SUBJECT.search(subject):
            raise PermanentError(f"NATS subject {subject!r} is not valid", detail={"reason": "bad_subject"})
        env = envelope(message, source=self.source)
        if self._deferred:
            await self._deferred_check(message.handler)
        blocked = self._blocked.get(message.handler)
        if blocked is not None:
            raise RetryLater(
                blocked, delay=BLOCKED_RETRY, counts_as_attempt=False, detail={"reason": "window_short"}
            )
        client, js = await self._connection()
        if not client.is_connected:
            # Nothing was sent, and the outage says nothing about the message: not an attempt.
            raise self._down("connection is down (reconnecting); nothing sent", {"reason": "disconnected"})
        headers = {**env.headers, "Nats-Msg-Id": env.dedupe_id}
        base = {"subject": subject, "msg_id": env.dedupe_id}
        try:
            # The request's own timeout bounds the wait for the ack (no second timer per message).
            ack = await js.publish(
                subject, env.body, timeout=self.publish_timeout, stream=self.stream, headers=headers
            )
        except nats.js.errors.NoStreamResponseError:
            raise await no_stream(js, subject, self.stream, base, retry_in=RECONNECT_WAIT) from None
        except TimeoutError:
            if not client.is_connected:  # the connection went down meanwhile: nothing known of the message
                raise self._down(
                    f"no JetStream ack for {subject!r}: the connection went down",
                    {**base, "reason": "disconnected"},
                ) from None
            raise RetryLater(
                f"no JetStream ack for {subject!r} within {self.publish_timeout:g}s",
                detail={**base, "reason": "ack_timeout"},
            ) from None
        except nats.js.errors.APIError as exc:
            detail = {**base, "code": exc.code, "err_code": exc.err_code}
            if exc.code == 400:
                raise PermanentError(
                    f"JetStream refused {subject!r}: {exc.description}", detail=detail
                ) from None
            raise RetryLater(f"JetStream error for {subject!r}: {exc.description}", detail=detail) from None
        except nats.errors.MaxPayloadError:
            raise PermanentError(
                f"message is larger than the server's max_payload ({client.max_payload} bytes)",
                detail={**base, "reason": "too_large"},
            ) from None
        except _CONNECTION_ERRORS as exc:
            why = f"publish to {subject!r} failed: {type(exc).__name__}: {self._text(exc)}"
            if not client.is_connected:
                raise self._down(why, {**base, "reason": "connection"}) from None
            raise RetryLater(
                f"{why}; not counted",
                delay=RECONNECT_WAIT,
                counts_as_attempt=False,
                detail={**base, "reason": "connection"},
            ) from None
        except nats.errors.Error as exc:
            raise RetryLater(
                f"publish to {subject!r} failed: {type(exc).__name__}: {self._text(exc)}",
                detail={**base, "reason": "error"},
            ) from None
        return {**base, "stream": ack.stream, "seq": ack.seq, "duplicate": bool(ack.duplicate)}

    # -- connection ---------------------------------------------------------------------

    def _link(self) -> _Link:
        return self._links.get()

    def _down(self, why: str, detail: dict[str, Any]) -> RetryLater:
        """The deferral while the connection is down: parked in a relay (the reconnect releases it)."""
        if self._recovery.parks:
            return self._recovery.parked(why, detail)
        return RetryLater(
            f"NATS {why}; not counted", delay=RECONNECT_WAIT, counts_as_attempt=False, detail=detail
        )

    async def _connection(self) -> tuple[Client, JetStreamContext]:
        """The loop's connection, opened on first use (and again if nats-py ever closed it)."""
        link = self._link()
        if link.client is None or link.js is None or link.client.is_closed:
            if link.probe.away and self._recovery.parks:
                raise self._down("not reachable yet (a probe tries every second)", {"reason": "connect"})
            async with link.lock:
                if link.client is None or link.js is None or link.client.is_closed:
                    try:
                        await self._open(link)
                    except RetryLater as exc:
                        if not self._recovery.parks:
                            raise
                        link.probe.start(self._recovery, str(exc), lambda: self._reopen(link))
                        raise self._down(str(exc), {"reason": "connect"}) from None
        assert link.client is not None and link.js is not None
        return link.client, link.js

    async def _open(self, link: _Link) -> None:
        client = await self._connect()
        link.client, link.js = client, client.jetstream(timeout=self.publish_timeout)

    async def _reopen(self, link: _Link) -> None:
        """The probe's one try, while no connection was ever made (nats-py reconnects an open one)."""
        async with link.lock:
            if link.client is None or link.js is None or link.client.is_closed:
                await self._open(link)

    async def _connect(self) -> Client:
        client = Client()

        async def disconnected() -> None:
            if not client.is_closed:  # closing at shutdown disconnects too: nothing to report then
                log.warning("NATS connection lost; reconnecting", extra={"action": "nats_disconnected"})

        try:
            # Reconnection never gives up once connected, so the first connect would not either:
            # it is bounded here, and a relay started while NATS is down retries its messages.
            async with asyncio.timeout(max(self.publish_timeout, 2.0)):
                await client.connect(
                    servers=self.servers,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    error_cb=self._on_error,
                    disconnected_cb=disconnected,
                    reconnected_cb=self._on_reconnected,
                    **self._connect_options(),
                )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            await client.close()
            raise RetryLater(
                f"cannot connect to NATS: {type(exc).__name__}: {self._text(exc)}; nothing sent",
                delay=RECONNECT_WAIT,
                counts_as_attempt=False,
                detail={"reason": "connect"},
            ) from None
        return client

    def _connect_options(self) -> dict[str, Any]:
        return {"name": "sqlalchemy-outbox relay", "reconnect_time_wait": RECONNECT_WAIT, **self._options}

    def _text(self, exc: BaseException) -> str:
        try:
            return self._redactor.text(str(exc) or type(exc).__name__)
        except Exception:
            return f"<unprintable {type(exc).__name__}>"

    async def _on_error(self, exc: Exception) -> None:
        log.debug("NATS client error: %s", self._text(exc), extra={"action": "nats_error"})

    async def _on_reconnected(self) -> None:
        log.info("NATS connection re-established", extra={"action": "nats_reconnected"})
        self._recovery.back()  # what waited for it goes now, in every relay

    # -- duplicate window -----------------------------------------------------------------

    def _route_subject(self, route: Route) -> str | None:
        if not set(self._subject.fields) <= STATIC:
            return None
        return self.subject.format(event_type=route.event_type, handler=route.name)

    async def _deferred_check(self, route: str) -> None:
        async with self._link().check_lock:  # one check; the route's other deliveries await its verdict
            check = self._deferred.pop(route, None)
            if check is None:
                return
            try:
                await self._check_window(check, at_start=False)
            except (OSError, TimeoutError, nats.errors.Error, RetryLater):
                self._deferred[route] = check  # still unreachable: the publish below says so

    async def _check_window(self, check: WindowCheck, *, at_start: bool) -> None:
        if check.gap <= 0:  # max_attempts=1: the relay never retries, only a requeue does
            return
        _, js = await self._connection()
        short = await check_window(js, check, stream=self.stream, subject=self.subject)
        if short is None:
            return
        if self.on_short_window == "refuse":
            if at_start:
                raise ConfigurationError(f"route {check.route!r}: {short}")
            self._blocked[check.route] = f"not publishing (on_short_window='refuse'): {short}"
        log.log(
            logging.ERROR if self.on_short_window == "refuse" else logging.WARNING,
            "route %s: %s",
            check.route,
            short,
            extra={"action": "nats_window_short", "handler": check.route, "longest_retry_gap": check.gap},
        )
