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

The relay hands the publisher a claim's messages at once
(``outbox_deliver_batch``): each is published with a reply subject of its own
under one subscription (``_nats_acks.py``), and their acks are awaited
together under one ``publish_timeout``, instead of one request, timer and wait
per message. Each ack, or its absence, decides its own message's outcome, as
in the table (``_nats_answers.py``).

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

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from outbox import ConfigurationError, Message, PermanentError, RetryLater, Route
from outbox._redact import Redactor

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

from ._broker_recovery import Probe, Recovery
from ._envelope import Envelope, RoutingTemplate, envelope
from ._nats_acks import AckInbox, read_ack
from ._nats_answers import RECONNECT_WAIT, Answers, with_base
from ._nats_config import BAD_STREAM, BAD_SUBJECT, RESERVED_OPTIONS, STATIC, check_servers, hosts, secrets
from ._nats_consumer import NatsConsumer
from ._nats_window import WindowCheck, check_window
from ._per_loop import PerLoop

__all__ = ["NatsConsumer", "NatsPublisher"]

log = logging.getLogger("outbox.integrations.nats")

#: How long a route whose window check failed under ``on_short_window="refuse"`` waits between tries.
BLOCKED_RETRY = 60.0


@dataclass(slots=True)
class _Link:
    """The connection of one event loop (the relay's): opened at first use, closed at shutdown."""

    client: Client | None = None
    js: JetStreamContext | None = None
    acks: AckInbox | None = None  # the client's reply subscription for acks
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
        where = hosts(self.servers)
        self._recovery = Recovery(f"nats://{where}", f"NATS at {where}")
        self._answers = Answers(self.publish_timeout, self.stream, self._text, self._recovery)
        self._links: PerLoop[_Link] = PerLoop(_Link)
        self._deferred: dict[str, WindowCheck] = {}  # window checks NATS was not reachable for at start
        self._blocked: dict[str, str] = {}  # route -> why it may not publish ("refuse", found late)

    @property
    def destination(self) -> str:
        """What a message is parked on while the servers are away: their addresses, never a credential."""
        return self._recovery.destination

    def __repr__(self) -> str:
        return f"<NatsPublisher {hosts(self.servers)} subject={self.subject!r} stream={self.stream!r}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """Passwords and tokens from the server URLs and ``connect_options``: masked wherever written."""
        return secrets(self.servers, self._options)

    async def outbox_start(self, route: Route, *, longest_retry_gap: float) -> None:
        """Compare the stream's duplicate window with the route's longest retry gap, once, at start."""
        check = WindowCheck(route.name, longest_retry_gap, self._route_subject(route))
        if check.subject is None and self.stream is None and self.on_short_window == "refuse":
            # Only a pattern route gets here: a subject that varies anyway was refused when built.
            raise ConfigurationError(
                f"route {route.name!r}: on_short_window='refuse' needs stream=...: its event type "
                f"{route.event_type!r} is a pattern, so subject {self.subject!r} varies per message"
            )
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
        """Publish one message and wait for its ack: the batch path with a batch of one."""
        (outcome,) = await self._publish_all([message])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def outbox_deliver_batch(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        """Publish every message at once, then wait for their JetStream acks together.

        One outcome per message, in order: its detail once JetStream acked it,
        else the exception its attempt ends with (see the module's table).
        ``publish_timeout`` bounds the wait for the whole batch's acks.
        """
        return await self._publish_all(messages)

    async def _publish_all(self, messages: list[Message]) -> list[dict[str, Any] | Exception]:
        outcomes: list[dict[str, Any] | Exception] = []
        ready: list[tuple[int, str, Envelope]] = []
        for route in dict.fromkeys(message.handler for message in messages) if self._deferred else ():
            await self._deferred_check(route)
        for index, message in enumerate(messages):
            try:
                subject, env = self._prepare(message)
            except (PermanentError, RetryLater) as exc:
                outcomes.append(exc)
                continue
            outcomes.append({})
            ready.append((index, subject, env))
        if not ready:
            return outcomes
        try:
            client, js, acks = await self._connection()
        except RetryLater as exc:  # nothing sent to anyone
            return [exc if isinstance(o, dict) else o for o in outcomes]
        except (OSError, nats.errors.Error) as exc:  # the ack subscription could not be made
            lost = self._answers.down(
                f"connection lost before publishing: {type(exc).__name__}: {self._text(exc)}; nothing sent",
                {"reason": "connection"},
            )
            return [lost if isinstance(o, dict) else o for o in outcomes]
        if not client.is_connected:
            # Nothing was sent, and the outage says nothing about the messages: not an attempt.
            down = self._answers.down(
                "connection is down (reconnecting); nothing sent", {"reason": "disconnected"}
            )
            return [down if isinstance(o, dict) else o for o in outcomes]
        waiting: list[tuple[int, str, str, str, asyncio.Future[Msg]]] = []
        for index, subject, env in ready:
            headers = {**env.headers, "Nats-Msg-Id": env.dedupe_id}
            if self.stream is not None:
                headers["Nats-Expected-Stream"] = self.stream
            reply, future = acks.expect()
            try:
                await client.publish(subject, env.body, reply=reply, headers=headers)
            except Exception as exc:
                acks.forget(reply)
                outcomes[index] = self._answers.refusal(exc, client, subject, env.dedupe_id)
                continue
            waiting.append((index, subject, env.dedupe_id, reply, future))
        if waiting:
            try:
                await asyncio.wait([future for *_, future in waiting], timeout=self.publish_timeout)
            finally:  # acked, timed out, or this call cancelled: no future is left waiting
                for *_, reply, future in waiting:
                    acks.forget(reply)
                    future.cancel()
        no_stream: dict[str, Exception] = {}
        for index, subject, dedupe_id, _, future in waiting:
            base = {"subject": subject, "msg_id": dedupe_id}
            try:
                if future.cancelled():
                    raise TimeoutError
                ack = read_ack(future.result())
            except nats.js.errors.NoStreamResponseError:
                if subject not in no_stream:  # asked once per subject and batch
                    no_stream[subject] = await self._answers.no_stream(js, subject)
                outcomes[index] = with_base(no_stream[subject], base)
            except Exception as exc:
                outcomes[index] = self._answers.refusal(exc, client, subject, dedupe_id)
            else:
                outcomes[index] = {**base, "stream": ack.stream, "seq": ack.seq, "duplicate": ack.duplicate}
        return outcomes

    def _prepare(self, message: Message) -> tuple[str, Envelope]:
        """The subject and envelope of a message this route may publish now; what refuses it, raised."""
        subject = self._subject.render(message)
        if BAD_SUBJECT.search(subject):
            raise PermanentError(f"NATS subject {subject!r} is not valid", detail={"reason": "bad_subject"})
        env = envelope(message, source=self.source)
        blocked = self._blocked.get(message.handler)
        if blocked is not None:
            raise RetryLater(
                blocked, delay=BLOCKED_RETRY, counts_as_attempt=False, detail={"reason": "window_short"}
            )
        return subject, env

    # -- connection ---------------------------------------------------------------------

    def _link(self) -> _Link:
        return self._links.get()

    async def _connection(self) -> tuple[Client, JetStreamContext, AckInbox]:
        """The loop's connection, opened on first use (and again if nats-py ever closed it)."""
        link = self._link()
        if _unopened(link):
            if link.probe.away and self._recovery.parks:
                raise self._answers.down(
                    "not reachable yet (a probe tries every second)", {"reason": "connect"}
                )
            async with link.lock:
                if _unopened(link):
                    try:
                        await self._open(link)
                    except RetryLater as exc:
                        if not self._recovery.parks:
                            raise
                        link.probe.start(self._recovery, str(exc), lambda: self._reopen(link))
                        raise self._answers.down(str(exc), {"reason": "connect"}) from None
        assert link.client is not None and link.js is not None and link.acks is not None
        await link.acks.ready()
        return link.client, link.js, link.acks

    async def _open(self, link: _Link) -> None:
        client = await self._connect()
        link.client, link.acks = client, AckInbox(client)
        link.js = client.jetstream(timeout=self.publish_timeout)

    async def _reopen(self, link: _Link) -> None:
        """The probe's one try, while no connection was ever made (nats-py reconnects an open one)."""
        async with link.lock:
            if _unopened(link):
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
        fields = set(self._subject.fields)
        # A pattern route's event type is each message's own: its subject varies like aggregate fields do.
        if not fields <= STATIC or (route.pattern and "event_type" in fields):
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
        _, js, _ = await self._connection()
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


def _unopened(link: _Link) -> bool:
    """No connection yet on this loop (or nats-py closed it for good): the next delivery opens one."""
    return link.client is None or link.js is None or link.acks is None or link.client.is_closed
