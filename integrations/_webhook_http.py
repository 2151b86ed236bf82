"""The webhook handler's HTTP layer: destinations, headers, Retry-After, a client per host, the POST.

What ``webhook.WebhookHandler`` decides (signing, the SSRF policy, breaker and
rate limit, what each status means) stays there; this module only knows how
to name a destination, talk HTTP to a checked address and read the answer.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC
from ipaddress import IPv6Address
from typing import Any

import httpx

from outbox import ConfigurationError
from outbox import __version__ as _outbox_version

from ._ssrf import IPAddress, literal_address

__all__ = [
    "EXCERPT_CHARS",
    "ConnectionsBusy",
    "MAX_CLIENTS",
    "MAX_RETRY_AFTER",
    "HostClients",
    "Target",
    "check_headers",
    "default_port",
    "destination_key",
    "excerpt",
    "parse_target",
    "payload_target",
    "post",
    "retry_after",
]

#: Characters of a response body kept in the attempt's detail.
EXCERPT_CHARS = 500
#: ``Retry-After`` values beyond this are capped, so a typo on the receiver cannot park a message for years.
MAX_RETRY_AFTER = 24 * 3600.0
#: HTTP clients kept per event loop (one per host name); idle ones beyond this are closed.
MAX_CLIENTS = 64

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
USER_AGENT = f"sqlalchemy-outbox/{_outbox_version} (+webhook)"


@dataclass(frozen=True, slots=True)
class Target:
    url: httpx.URL
    host: str  # ASCII (IDNA) host name or IP literal, no brackets, as the URL spells it
    authority: str  # host[:port] as the Host header carries it
    destination: str  # destination_key(url): what the breaker, rate limit and connection cap key on

    @property
    def https(self) -> bool:
        return self.url.scheme == "https"


def destination_key(url: httpx.URL) -> str:
    """``host:port``, spelled the same for every URL that reaches the same receiver.

    The circuit breaker, the rate limit and the connection cap are per
    destination; keyed on the URL's text, ``https://Example.com.:443/`` and
    ``https://example.com/`` would each get the full rate, and a breaker that
    never opens for the other spelling. The host is lower-cased, in its IDNA
    (ASCII) form, without one trailing dot; an IP address is written
    canonically (IPv6 compressed, in brackets; an IPv4-mapped IPv6 address
    and a numeric shorthand such as ``127.1`` as dotted IPv4); the port is
    always there, 80 or 443 when the URL has none.
    """
    host = url.raw_host.decode("ascii").lower().removesuffix(".")  # httpx gives the IDNA form
    port = url.port or (443 if url.scheme == "https" else 80)
    address = literal_address(host)
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if isinstance(address, IPv6Address):
        return f"[{address.compressed}]:{port}"
    return f"{host if address is None else address}:{port}"


def parse_target(url: object) -> Target:
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
    return Target(url=parsed, host=host, authority=authority, destination=destination_key(parsed))


def payload_target(payload: Any) -> Target:
    """The destination a payload names in ``url`` (handlers with ``url=None``), or ValueError."""
    return parse_target(payload.get("url") if isinstance(payload, Mapping) else None)


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
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


#: Connections open and kept alive as the deliveries in flight need them (idle ones close after 5 s).
UNLIMITED_POOL = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=5.0)


class ConnectionsBusy(Exception):
    """Every connection a destination may have stayed busy for the whole wait; nothing was sent."""


@dataclass(slots=True)
class _Slots:
    free: asyncio.Semaphore
    users: int = 0  # holding a slot or waiting for one: the entry goes when the last one leaves


class HostClients:
    """HTTP clients of one event loop, one per host name, and each destination's connection slots.

    Requests go to a checked IP with the host name in ``Host`` and in TLS SNI.
    httpx pools connections by IP and port, so a shared client could reuse a
    TLS connection authenticated for one host name to talk to another host that
    resolves to the same IP; a client per host name rules that out.

    httpx's pool sets no limit of its own: without ``max_connections`` the
    relay's concurrency (and a queue's cap) bounds the requests in flight, and
    with it :meth:`slot` does, before the request's timeout starts. A limit in
    httpx's pool would make deliveries queue for a connection inside that
    timeout. httpx's default pool stops at 100 connections per client.
    """

    def __init__(
        self, timeout: float, ssl_context: ssl.SSLContext | None, max_connections: int | None = None
    ) -> None:
        self._timeout = timeout
        self._verify: ssl.SSLContext | bool = True if ssl_context is None else ssl_context
        self._clients: OrderedDict[str, httpx.AsyncClient] = OrderedDict()
        self._busy: dict[str, int] = {}
        self._max_connections = max_connections
        self._slots: dict[str, _Slots] = {}

    @asynccontextmanager
    async def slot(self, destination: str, *, wait: float) -> AsyncIterator[None]:
        """One of the ``max_connections`` requests ``destination`` (a :func:`destination_key`) may have open.

        Waiters are served in arrival order; one that waited ``wait`` seconds
        raises :class:`ConnectionsBusy` instead. Without ``max_connections``
        every request has a slot at once.
        """
        if self._max_connections is None:
            yield
            return
        slots = self._slots.get(destination)
        if slots is None:
            slots = self._slots[destination] = _Slots(asyncio.Semaphore(self._max_connections))
        slots.users += 1
        try:
            try:
                async with asyncio.timeout(wait):
                    await slots.free.acquire()
            except TimeoutError:
                raise ConnectionsBusy(destination) from None
            try:
                yield
            finally:
                slots.free.release()
        finally:
            slots.users -= 1
            if not slots.users:
                del self._slots[destination]

    @asynccontextmanager
    async def use(self, host: str) -> AsyncIterator[httpx.AsyncClient]:
        client = self._clients.get(host)
        if client is None:
            client = self._clients[host] = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout),
                follow_redirects=False,
                # Proxy variables from the environment would route around the SSRF guard.
                trust_env=False,
                headers={"user-agent": USER_AGENT},
                verify=self._verify,
                limits=UNLIMITED_POOL,
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


def default_port(target: Target) -> int:
    return 443 if target.https else 80


async def post(
    client: httpx.AsyncClient,
    target: Target,
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
            return response.status_code, response.headers, await excerpt(response)
        finally:
            await response.aclose()
    assert failure is not None
    raise failure


async def excerpt(response: httpx.Response) -> str:
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
