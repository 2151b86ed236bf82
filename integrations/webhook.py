"""Signed webhooks over httpx: Standard Webhooks signatures, SSRF guard, circuit breaker, rate limit.

::

    from outbox.integrations.webhook import WebhookHandler

    ob.route(
        "order.paid",
        WebhookHandler("https://partner.example/hooks", secret="whsec_..."),
        name="partner_webhook",
        max_attempts=8,
    )

Each delivery POSTs the message payload as JSON, signed with every configured
secret. What happens next depends on the answer:

============================  ================================================================
2xx                           delivered; the attempt's detail records status and host
408, 425, 429, 5xx            retried (``Retry-After`` honoured, seconds or HTTP date)
3xx                           dead: redirects are never followed
410 Gone                      dead, logged as ``webhook_gone``: the receiver retired the URL
other 4xx                     dead
cannot connect, DNS failure   rescheduled without using an attempt (the receiver is down)
connection lost, timeout      retried
refused by the SSRF guard     dead, the reason recorded
breaker open                  parked until a trial request succeeds, no attempt used; a 502,
                              503, 504 or unreachable receiver with the breaker open neither
rate limited                  rescheduled without using an attempt (``counts_as_attempt=False``)
all connections busy          rescheduled without using an attempt, nothing sent
============================  ================================================================

While a breaker is open, one delivery per relay tries the destination every
``breaker_cooldown`` seconds (a second by default) and the others are parked
on it (``_webhook_breaker``): a successful trial closes the breaker for every
relay and sends everything parked at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from outbox import ConfigurationError, Message, PayloadError, PermanentError, RetryLater
from outbox._redact import _SECRET_KEY
from outbox._tracing import TRACE_HEADERS, current_headers

from ._breaker import CircuitBreaker
from ._ratelimit import RateLimited, RateLimiters
from ._signing import SECRET_PREFIX, WebhookVerificationError, generate_secret, parse_secrets, sign, verify
from ._ssrf import AddressPolicy, BlockedAddress, IPNetwork, ResolutionFailed, literal_address
from ._webhook_answers import classify
from ._webhook_answers import healthy as is_healthy
from ._webhook_breaker import behind_breaker
from ._webhook_breaker import permit as breaker_permit
from ._webhook_http import (
    ConnectionsBusy,
    HostClients,
    Target,
    check_headers,
    default_port,
    parse_target,
    payload_target,
    post,
)
from ._webhook_http import retry_after as retry_after  # importable from here, as before
from ._webhook_receive import WebhookReceipt, WebhookReceiver, areceive, receive

if TYPE_CHECKING:
    from outbox._breaker_board import BreakerBoard

__all__ = [
    "WebhookHandler",
    "WebhookReceipt",
    "WebhookReceiver",
    "WebhookVerificationError",
    "areceive",
    "generate_secret",
    "receive",
    "verify",
    "webhook_id",
]

#: The longest a delivery waits for one of its destination's ``max_connections``; then it is
#: rescheduled (``CONNECTIONS_BUSY_RETRY`` later), so a full destination never holds it for long.
MAX_CONNECTION_WAIT = 5.0
CONNECTIONS_BUSY_RETRY = 1.0
#: How long a message waits when its receiver could not be reached (until the breaker takes over).
UNREACHABLE_RETRY = 2.0
_WEBHOOK_ID_NAMESPACE = uuid.UUID("7b1c6f0e-3a52-4c0b-9d1e-5f0a9b8c2d41")


def webhook_id(message: Message) -> str:
    """The ``webhook-id`` a message is sent with: the same on every retry and every requeue.

    It derives from the event id and the route name, so two routes delivering
    one event get different ids, and a receiver can deduplicate on it.
    """
    name = f"{uuid.UUID(str(message.event_id))}:{message.handler}"  # one spelling, however stored
    return "msg_" + uuid.uuid5(_WEBHOOK_ID_NAMESPACE, name).hex


def _number(what: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{what} must be a number, got {value!r}")
    if value <= minimum:
        raise ConfigurationError(f"{what} must be > {minimum:g}, got {value!r}")
    return float(value)


class WebhookHandler:
    """POST each message's payload as signed JSON to a fixed URL or to ``payload["url"]``.

    ``secret`` is one ``whsec_...`` secret or a list (every one signs; rotate by
    adding the new secret, switching receivers, then dropping the old one).
    ``timeout`` bounds DNS plus the whole request. ``allowed_networks`` lists
    CIDRs the SSRF guard lets through (everything non-public is refused
    otherwise). ``headers`` are sent with every request to the fixed ``url``;
    values of sensitive ones (``Authorization``, ``*token*``, ...) are masked
    in history like the secrets. With ``url=None`` the destination comes from
    each payload, so ``headers`` are refused unless
    ``headers_to_payload_urls=True`` says every such host may see them. After
    ``breaker_threshold`` consecutive failures a destination's breaker opens
    for every relay of the database (``outbox_breaker``): one trial request
    every ``breaker_cooldown`` seconds tests it, the other deliveries are
    parked, and the first trial that succeeds releases them all. ``rate_limit`` caps requests per second per
    destination across every concurrent delivery of the relay, and
    ``max_connections`` caps the requests open to one destination at once
    (``None``: as many as the relay has deliveries in flight). A destination
    is the URL's ``host:port`` spelled one way, so ``https://Example.com.:443/``
    and ``https://example.com/`` share one. ``ssl_context`` replaces the
    default certificate verification (certifi's CAs), e.g. to trust a private
    CA; certificates are always checked against the URL's host name, even
    though the connection goes to the checked IP.
    ``send_trace_context=True`` adds the delivery's ``traceparent`` (and
    ``tracestate``) to each request, so a receiver that traces can join the
    trace; off by default, because it tells the receiver your trace ids.
    """

    def __init__(
        self,
        url: str | None = None,
        secret: str | Sequence[str] | None = None,
        *,
        timeout: float = 10.0,
        allowed_networks: Iterable[str | IPNetwork] = (),
        headers: Mapping[str, str] | None = None,
        breaker_threshold: int = 5,
        breaker_cooldown: float = 1.0,
        rate_limit: float | None = None,
        max_connections: int | None = None,
        ssl_context: ssl.SSLContext | None = None,
        headers_to_payload_urls: bool = False,
        send_trace_context: bool = False,
    ) -> None:
        if secret is None:
            raise ConfigurationError(
                "WebhookHandler needs secret='whsec_...' (or a list of them): webhooks are always signed; "
                "generate one with outbox.integrations.webhook.generate_secret()"
            )
        self._keys = parse_secrets(secret)
        self._secrets: list[str] = [secret] if isinstance(secret, str) else list(secret)
        self.timeout = _number("timeout", timeout)
        self.policy = AddressPolicy(allowed_networks)
        self.headers = check_headers(headers)
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown, trial_timeout=self.timeout)
        self._limiters = None if rate_limit is None else RateLimiters(_number("rate_limit", rate_limit))
        self.rate_limit = None if self._limiters is None else self._limiters.rate
        if max_connections is not None and (
            isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1
        ):
            raise ConfigurationError(
                f"max_connections must be an integer >= 1 or None, got {max_connections!r}"
            )
        self.max_connections = max_connections
        self.ssl_context = ssl_context
        if not isinstance(headers_to_payload_urls, bool):
            raise ConfigurationError(
                f"headers_to_payload_urls must be True or False, got {headers_to_payload_urls!r}"
            )
        if url is None and self.headers and not headers_to_payload_urls:
            # Names only, never values: they may be credentials.
            raise ConfigurationError(
                f"headers {', '.join(sorted(self.headers))} would go to whatever host a message's "
                "payload['url'] names (url=None); give the handler a fixed url, or pass "
                "headers_to_payload_urls=True if every such host may see them"
            )
        if url is not None and headers_to_payload_urls:
            raise ConfigurationError("headers_to_payload_urls=True applies only with url=None")
        self.headers_to_payload_urls = headers_to_payload_urls
        if not isinstance(send_trace_context, bool):
            raise ConfigurationError(f"send_trace_context must be True or False, got {send_trace_context!r}")
        self.send_trace_context = send_trace_context
        # A traceparent given in headers= is sent as given, never beside the delivery's own.
        self._send_trace = send_trace_context and not any(n.lower() in TRACE_HEADERS for n in self.headers)
        self.url = url
        self._target: Target | None = None
        if url is not None:
            try:
                self._target = parse_target(url)
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
            literal = literal_address(self._target.host)
            if literal is not None:
                try:
                    self.policy.check(self._target.host, literal)
                except BlockedAddress as exc:
                    raise ConfigurationError(str(exc)) from None
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HostClients] = (
            weakref.WeakKeyDictionary()
        )
        self._pools_lock = threading.Lock()

    def __repr__(self) -> str:
        target = self._target.authority if self._target is not None else "payload['url']"
        return f"<WebhookHandler {target} secrets={len(self._keys)}>"

    # -- relay hooks --------------------------------------------------------------------

    def outbox_secrets(self) -> list[str]:
        """Values the relay masks wherever they would be written: secrets and sensitive header values."""
        found: list[str] = []
        for secret in self._secrets:  # all validated strings; the key part alone is as secret
            found += [secret, secret.removeprefix(SECRET_PREFIX)]
        for name, value in self.headers.items():
            if _SECRET_KEY.search(name) and value.strip():
                found.append(value)
                _, _, credentials = value.strip().partition(" ")  # "Bearer <token>": the token too
                if credentials.strip():
                    found.append(credentials.strip())
        return found

    def outbox_breaker_states(self) -> dict[str, bool]:
        """``{destination: is_open}`` (``host:port``) for the relay's ``outbox_breaker_open`` gauge."""
        return self.breaker.states()

    def outbox_share_breakers(self, board: BreakerBoard) -> None:
        """The relay's copy of ``outbox_breaker``: this handler's breakers follow it and write to it."""
        self.breaker.share(board)

    async def outbox_shutdown(self) -> None:
        """Close the HTTP clients of the running loop (the relay calls this when it stops)."""
        loop = asyncio.get_running_loop()
        with self._pools_lock:
            pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.aclose()

    # -- emit-time check -----------------------------------------------------------------

    def outbox_validate(self, payload: Any) -> None:
        """Refuse at emit, with ``PayloadError``, a payload URL delivery would refuse.

        ``emit()`` calls it with the route's payload. With a fixed ``url`` there
        is nothing to check beyond JSON. With ``url=None`` the payload's URL gets
        the checks that need no network: its form, and the SSRF policy for an IP
        literal or a ``localhost`` name. Other host names are resolved and
        checked at delivery only; DNS at emit would slow the request and prove
        nothing about the answer at delivery time.
        """
        if self._target is not None:
            return
        try:
            self.policy.precheck(payload_target(payload).host)
        except (ValueError, BlockedAddress) as exc:
            raise PayloadError(f"payload['url']: {exc}") from None

    # -- delivery -----------------------------------------------------------------------

    async def __call__(self, message: Message) -> dict[str, Any]:
        target = self._destination(message)
        body = self._body(message)
        msg_id = webhook_id(message)
        permit = await breaker_permit(self.breaker, target, message.handler)
        # The breaker hears only about the destination's health: a refusal before any request
        # (SSRF guard, rate limit, connection cap, cancellation) is no verdict, a 4xx proves the
        # host is up.
        healthy: bool | None = None
        try:
            await self._wait_for_rate(target)
            wait = min(MAX_CONNECTION_WAIT, self.timeout / 2)
            try:
                async with self._pool().slot(target.destination, wait=wait):
                    try:
                        status, headers, excerpt = await self._send(target, msg_id, body)
                    except RetryLater:
                        healthy = False
                        raise
            except ConnectionsBusy:
                raise RetryLater(
                    f"all {self.max_connections} connections to {target.destination} stayed busy; "
                    "not sending",
                    delay=CONNECTIONS_BUSY_RETRY,
                    detail={
                        "reason": "connections_busy",
                        "host": target.authority,
                        "destination": target.destination,
                        "max_connections": self.max_connections,
                    },
                    counts_as_attempt=False,
                ) from None
            healthy = is_healthy(status)
            return classify(message, target, msg_id, status, headers, excerpt)
        except RetryLater as exc:
            if healthy is False:
                instead = behind_breaker(exc, permit, self.breaker, target)
                if instead is not None:
                    raise instead from None
            raise
        finally:
            if healthy is None:
                permit.release()
            elif healthy:
                permit.success()
            else:
                permit.failure()  # a no-op when reported above: a permit takes one verdict

    def _destination(self, message: Message) -> Target:
        if self._target is not None:
            return self._target
        try:
            return payload_target(message.payload)
        except ValueError as exc:
            raise PermanentError(f"payload['url']: {exc}", detail={"reason": "bad_url"}) from None

    def _body(self, message: Message) -> bytes:
        try:
            return json.dumps(message.payload, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:  # emit() checks payloads; a hand-written row may not be
            raise PermanentError(f"payload is not JSON-serialisable: {exc}") from None

    async def _wait_for_rate(self, target: Target) -> None:
        if self._limiters is None:
            return
        try:
            await self._limiters[target.destination].acquire(max_wait=self.timeout)
        except RateLimited as exc:
            raise RetryLater(
                f"rate limit for {target.destination} reached; rescheduled",
                delay=exc.wait,
                detail={
                    "rate_limit": "deferred",
                    "host": target.authority,
                    "destination": target.destination,
                    "retry_in": round(exc.wait, 3),
                },
                counts_as_attempt=False,
            ) from None

    def _pool(self) -> HostClients:
        loop = asyncio.get_running_loop()
        with self._pools_lock:
            pool = self._pools.get(loop)
            if pool is None:
                pool = self._pools[loop] = HostClients(self.timeout, self.ssl_context, self.max_connections)
            return pool

    async def _send(self, target: Target, msg_id: str, body: bytes) -> tuple[int, httpx.Headers, str]:
        """POST once; the status, headers and an excerpt of the body, or a retryable/permanent error."""
        timestamp = int(time.time())
        headers = {
            # Opt-in: trace and span ids tell the receiver which of our traces sent it (docs/tracing.md).
            **(current_headers() if self._send_trace else {}),
            **self.headers,
            "content-type": "application/json",
            "host": target.authority,
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self._keys, msg_id, timestamp, body),
        }
        extensions = {"sni_hostname": target.host} if target.https else {}
        try:
            async with asyncio.timeout(self.timeout):
                addresses = await self.policy.resolve(target.host, target.url.port or default_port(target))
                async with self._pool().use(target.host) as client:
                    return await post(client, target, addresses, headers, extensions, body)
        except BlockedAddress as exc:
            raise PermanentError(
                str(exc), detail={"reason": "ssrf_refused", "host": target.authority, "refused": exc.reason}
            ) from None
        except ResolutionFailed as exc:
            raise RetryLater(
                f"{exc}; not counted",
                delay=UNREACHABLE_RETRY,
                counts_as_attempt=False,
                detail={"reason": "dns", "host": target.authority},
            ) from exc
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            if _tls_refused(exc):  # a certificate or TLS set-up problem is configuration, not an outage
                raise _connection_failed(target, exc) from exc
            # Refused, reset or unanswered before a byte of the request went out: the receiver is
            # down or unreachable, which says nothing about the message (the breaker counts it).
            raise RetryLater(
                f"cannot connect to {target.authority}: {type(exc).__name__}: {exc}; not counted",
                delay=UNREACHABLE_RETRY,
                counts_as_attempt=False,
                detail={"reason": "unreachable", "host": target.authority},
            ) from exc
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise RetryLater(
                f"no response from {target.authority} within {self.timeout:g}s",
                detail={"reason": "timeout", "host": target.authority},
            ) from exc
        except httpx.TransportError as exc:
            raise _connection_failed(target, exc) from exc


def _connection_failed(target: Target, exc: Exception) -> RetryLater:
    """A counted retry: the connection failed in a way that may say something about this request."""
    return RetryLater(
        f"connection to {target.authority} failed: {type(exc).__name__}: {exc}",
        detail={"reason": "connection", "host": target.authority},
    )


def _tls_refused(exc: BaseException) -> bool:
    """Whether a failed connection failed in its TLS handshake (a certificate, a protocol)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "SSL" in str(exc) or "certificate" in str(exc)
