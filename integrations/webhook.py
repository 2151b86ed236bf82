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
connection error, timeout     retried
refused by the SSRF guard     dead, the reason recorded
breaker open, rate limited    rescheduled without using an attempt (``counts_as_attempt=False``)
============================  ================================================================
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import re
import ssl
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import httpx

from outbox import ConfigurationError, Message, PayloadError, PermanentError, RetryLater
from outbox import __version__ as _outbox_version
from outbox._redact import _SECRET_KEY
from outbox._tracing import TRACE_HEADERS, current_headers

from ._breaker import CircuitBreaker, CircuitOpen
from ._ratelimit import RateLimited, RateLimiters
from ._signing import SECRET_PREFIX, WebhookVerificationError, generate_secret, parse_secrets, sign, verify
from ._ssrf import AddressPolicy, BlockedAddress, IPAddress, IPNetwork, ResolutionFailed, literal_address

__all__ = [
    "WebhookHandler",
    "WebhookVerificationError",
    "generate_secret",
    "verify",
    "webhook_id",
]

log = logging.getLogger("outbox.integrations.webhook")

#: Characters of a response body kept in the attempt's detail.
EXCERPT_CHARS = 500
#: ``Retry-After`` values beyond this are capped, so a typo on the receiver cannot park a message for years.
MAX_RETRY_AFTER = 24 * 3600.0
#: HTTP clients kept per event loop (one per destination host); idle ones beyond this are closed.
MAX_CLIENTS = 64

_RETRYABLE = frozenset({408, 425, 429})
_RESERVED_HEADERS = frozenset(
    {
        "host",
        "content-type",
        "content-length",
        "transfer-encoding",
        "connection",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    }
)
_TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_USER_AGENT = f"sqlalchemy-outbox/{_outbox_version} (+webhook)"
_WEBHOOK_ID_NAMESPACE = uuid.UUID("7b1c6f0e-3a52-4c0b-9d1e-5f0a9b8c2d41")


def webhook_id(message: Message) -> str:
    """The ``webhook-id`` a message is sent with: the same on every retry and every requeue.

    It derives from the event id and the route name, so two routes delivering
    one event get different ids, and a receiver can deduplicate on it.
    """
    name = f"{uuid.UUID(str(message.event_id))}:{message.handler}"  # one spelling, however stored
    return "msg_" + uuid.uuid5(_WEBHOOK_ID_NAMESPACE, name).hex


@dataclass(frozen=True, slots=True)
class _Target:
    url: httpx.URL
    host: str  # ASCII (IDNA) host name or IP literal, no brackets
    authority: str  # host[:port] as the Host header carries it; also the breaker and rate-limit key

    @property
    def https(self) -> bool:
        return self.url.scheme == "https"


def _parse_target(url: object) -> _Target:
    """A destination URL, or ``ValueError`` saying why it cannot be one."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"the webhook URL must be a non-empty string, got {type(url).__name__}")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid webhook URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"webhook URLs must be http or https, not {parsed.scheme or 'relative'!r}")
    if not parsed.raw_host:
        raise ValueError("the webhook URL has no host")
    if parsed.userinfo:
        raise ValueError("webhook URLs must not carry credentials; send them with headers={...} instead")
    host = parsed.raw_host.decode("ascii")
    literal = literal_address(host)
    shown = f"[{host}]" if literal is not None and literal.version == 6 else host
    authority = shown if parsed.port is None else f"{shown}:{parsed.port}"
    return _Target(url=parsed, host=host, authority=authority)


def _payload_target(payload: Any) -> _Target:
    """The destination a payload names in ``url`` (handlers with ``url=None``), or ValueError."""
    return _parse_target(payload.get("url") if isinstance(payload, Mapping) else None)


def _number(what: str, value: object, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{what} must be a number, got {value!r}")
    if value <= minimum:
        raise ConfigurationError(f"{what} must be > {minimum:g}, got {value!r}")
    return float(value)


def _check_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    checked: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not _TOKEN.match(name):
            raise ConfigurationError(f"header name {name!r} is not a valid HTTP header name")
        if name.lower() in _RESERVED_HEADERS:
            raise ConfigurationError(
                f"header {name!r} is set by the webhook handler and cannot be overridden"
            )
        if not isinstance(value, str) or any(c in value for c in "\r\n\x00"):
            raise ConfigurationError(f"header {name!r} must be a string without line breaks")
        checked[name] = value
    return checked


def retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` asks for (delta-seconds or HTTP date), capped; None if absent or bad."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        current = time.time() if now is None else now
        seconds = when.timestamp() - current
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class _Clients:
    """HTTP clients of one event loop, one per destination host.

    Requests go to a checked IP with the host name in ``Host`` and in TLS SNI.
    httpx pools connections by IP and port, so a shared client could reuse a
    TLS connection authenticated for one host name to talk to another host that
    resolves to the same IP; a client per host name rules that out.
    """

    def __init__(self, timeout: float, ssl_context: ssl.SSLContext | None) -> None:
        self._timeout = timeout
        self._verify: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self._clients: OrderedDict[str, httpx.AsyncClient] = OrderedDict()
        self._busy: dict[str, int] = {}

    @asynccontextmanager
    async def use(self, host: str) -> AsyncIterator[httpx.AsyncClient]:
        client = self._clients.get(host)
        if client is None:
            client = self._clients[host] = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                follow_redirects=False,
                # Proxy variables from the environment would route around the SSRF guard.
                trust_env=False,
                headers={"user-agent": _USER_AGENT},
                verify=self._verify,
            )
        self._clients.move_to_end(host)
        self._busy[host] = self._busy.get(host, 0) + 1
        try:
            yield client
        finally:
            self._busy[host] -= 1
            if not self._busy[host]:
                del self._busy[host]
            await self._trim()

    async def _trim(self) -> None:
        idle = [h for h in self._clients if h not in self._busy]
        for host in idle[: max(0, len(self._clients) - MAX_CLIENTS)]:
            await self._clients.pop(host).aclose()

    async def aclose(self) -> None:
        clients = list(self._clients.values())
        self._clients.clear()
        for client in clients:
            await client.aclose()


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
    ``breaker_threshold`` consecutive failures a host is paused for
    ``breaker_cooldown`` seconds. ``rate_limit`` caps requests per second
    per host across every concurrent delivery of the relay. ``ssl_context``
    replaces the default certificate verification (certifi's CAs), e.g. to
    trust a private CA; certificates are always checked against the URL's
    host name, even though the connection goes to the checked IP.
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
        breaker_cooldown: float = 30.0,
        rate_limit: float | None = None,
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
        self.headers = _check_headers(headers)
        self.breaker = CircuitBreaker(breaker_threshold, breaker_cooldown)
        self._limiters = None if rate_limit is None else RateLimiters(_number("rate_limit", rate_limit))
        self.rate_limit = None if self._limiters is None else self._limiters.rate
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
        self._target: _Target | None = None
        if url is not None:
            try:
                self._target = _parse_target(url)
            except ValueError as exc:
                raise ConfigurationError(str(exc)) from None
            literal = literal_address(self._target.host)
            if literal is not None:
                try:
                    self.policy.check(self._target.host, literal)
                except BlockedAddress as exc:
                    raise ConfigurationError(str(exc)) from None
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Clients] = (
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
        """``{host: is_open}`` for the relay's ``outbox_breaker_open`` gauge."""
        return self.breaker.states()

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
            self.policy.precheck(_payload_target(payload).host)
        except (ValueError, BlockedAddress) as exc:
            raise PayloadError(f"payload['url']: {exc}") from None

    # -- delivery -----------------------------------------------------------------------

    async def __call__(self, message: Message) -> dict[str, Any]:
        target = self._destination(message)
        body = self._body(message)
        msg_id = webhook_id(message)
        try:
            permit = self.breaker.acquire(target.authority)
        except CircuitOpen as exc:
            raise RetryLater(
                f"circuit breaker for {target.authority} is open; not sending",
                delay=exc.remaining,
                detail={
                    "breaker": "half-open" if exc.half_open else "open",
                    "host": target.authority,
                    "retry_in": round(exc.remaining, 3),
                },
                counts_as_attempt=False,
            ) from None
        # The breaker hears only about the destination's health: a refusal before any request
        # (SSRF guard, rate limit, cancellation) is no verdict, a 4xx proves the host is up.
        healthy: bool | None = None
        try:
            await self._wait_for_rate(target)
            try:
                status, headers, excerpt = await self._send(target, msg_id, body)
            except RetryLater:
                healthy = False
                raise
            healthy = not (status >= 500 or status in _RETRYABLE)
            return self._classify(message, target, msg_id, status, headers, excerpt)
        finally:
            if healthy is None:
                permit.release()
            elif healthy:
                permit.success()
            else:
                permit.failure()

    def _destination(self, message: Message) -> _Target:
        if self._target is not None:
            return self._target
        try:
            return _payload_target(message.payload)
        except ValueError as exc:
            raise PermanentError(f"payload['url']: {exc}", detail={"reason": "bad_url"}) from None

    def _body(self, message: Message) -> bytes:
        try:
            return json.dumps(message.payload, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:  # emit() checks payloads; a hand-written row may not be
            raise PermanentError(f"payload is not JSON-serialisable: {exc}") from None

    async def _wait_for_rate(self, target: _Target) -> None:
        if self._limiters is None:
            return
        try:
            await self._limiters[target.authority].acquire(max_wait=self.timeout)
        except RateLimited as exc:
            raise RetryLater(
                f"rate limit for {target.authority} reached; rescheduled",
                delay=exc.wait,
                detail={"rate_limit": "deferred", "host": target.authority, "retry_in": round(exc.wait, 3)},
                counts_as_attempt=False,
            ) from None

    def _pool(self) -> _Clients:
        loop = asyncio.get_running_loop()
        with self._pools_lock:
            pool = self._pools.get(loop)
            if pool is None:
                pool = self._pools[loop] = _Clients(self.timeout, self.ssl_context)
            return pool

    async def _send(self, target: _Target, msg_id: str, body: bytes) -> tuple[int, httpx.Headers, str]:
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
                addresses = await self.policy.resolve(target.host, target.url.port or _default_port(target))
                async with self._pool().use(target.host) as client:
                    return await _post(client, target, addresses, headers, extensions, body)
        except BlockedAddress as exc:
            raise PermanentError(
                str(exc), detail={"reason": "ssrf_refused", "host": target.authority, "refused": exc.reason}
            ) from None
        except ResolutionFailed as exc:
            raise RetryLater(str(exc), detail={"reason": "dns", "host": target.authority}) from exc
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise RetryLater(
                f"no response from {target.authority} within {self.timeout:g}s",
                detail={"reason": "timeout", "host": target.authority},
            ) from exc
        except httpx.TransportError as exc:
            raise RetryLater(
                f"connection to {target.authority} failed: {type(exc).__name__}: {exc}",
                detail={"reason": "connection", "host": target.authority},
            ) from exc

    def _classify(
        self,
        message: Message,
        target: _Target,
        msg_id: str,
        status: int,
        headers: httpx.Headers,
        excerpt: str,
    ) -> dict[str, Any]:
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
                    "destination": target.authority,
                },
            )
            raise PermanentError(f"HTTP 410 Gone from {target.authority}: endpoint retired", detail=detail)
        if 400 <= status < 500:
            raise PermanentError(f"HTTP {status} from {target.authority}", detail=detail)
        raise RetryLater(f"unexpected HTTP status {status} from {target.authority}", detail=detail)


def _default_port(target: _Target) -> int:
    return 443 if target.https else 80


async def _post(
    client: httpx.AsyncClient,
    target: _Target,
    addresses: list[IPAddress],
    headers: dict[str, str],
    extensions: dict[str, Any],
    body: bytes,
) -> tuple[int, httpx.Headers, str]:
    failure: httpx.ConnectError | None = None
    for address in addresses:  # every one was checked; try the next only if one cannot be reached
        url = target.url.copy_with(host=str(address))
        request = client.build_request("POST", url, content=body, headers=headers, extensions=extensions)
        try:
            response = await client.send(request, stream=True)
        except httpx.ConnectError as exc:
            failure = exc
            continue
        try:
            return response.status_code, response.headers, await _excerpt(response)
        finally:
            await response.aclose()
    assert failure is not None
    raise failure


async def _excerpt(response: httpx.Response) -> str:
    """The start of the body, read no further than needed (a receiver may answer with megabytes)."""
    limit = EXCERPT_CHARS * 4  # UTF-8 needs at most four bytes a character
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    text = b"".join(chunks)[:limit].decode("utf-8", errors="replace")
    return text[:EXCERPT_CHARS]
