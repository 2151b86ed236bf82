"""What stands between the dashboard and a hostile page or network: headers, origins, hosts, auth.

The dashboard acts on production data (requeue, resend, discard, pause), so it is
built to be exposed only on purpose. Each check here answers one attack:

- DNS rebinding: a page on ``evil.example`` that resolves to 127.0.0.1 reads
  the dashboard as its own origin. The ``Host`` header gives it away, so an
  app without auth answers only the host names it was told (loopback names
  for ``outbox dashboard``).
- Cross-site request forgery: a form on another site posts to the dashboard
  with the operator's cookies or Basic credentials. Browsers state where a
  request comes from (``Sec-Fetch-Site``, ``Origin``); a mutation must come
  from the dashboard's own origin, and a POST that states neither is refused.
- Script injection: payloads and error texts are attacker-controlled. The
  templates escape everything, and the Content-Security-Policy forbids inline
  script and style, so even a missed escape runs nothing.
- Clickjacking: no framing (``X-Frame-Options`` and ``frame-ancestors``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ACTIONS",
    "Action",
    "Auth",
    "SecurityHeaders",
    "cross_site_problem",
    "token_auth",
]

Action = Literal["read", "requeue", "discard", "pause", "retry", "resend"]
ACTIONS: tuple[Action, ...] = ("read", "requeue", "discard", "pause", "retry", "resend")

#: ``auth(request, action) -> bool``, sync or async: may this request do this?
Auth = Callable[[Request, Action], "bool | Awaitable[bool]"]

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)

_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


class SecurityHeaders:
    """Every response, errors and static files included, carries the policy headers.

    Pages also get ``Cache-Control: no-store``: they show payloads, which must
    not linger in a shared cache or the browser's disk cache.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None = None) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None and not _host_allowed(Headers(scope=scope), self.allowed_hosts):
            await _plain(
                send,
                421,
                "This dashboard answers only to its configured host names"
                " (outbox dashboard --allowed-host, or create_app(allowed_hosts=...)).",
            )
            return
        static = str(scope.get("path", "")).startswith("/static/")

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers += [(n, v) for n, v in _HEADERS if n not in names]
                if not static and b"cache-control" not in names:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


def _host_allowed(headers: Headers, allowed: set[str]) -> bool:
    host = headers.get("host", "").lower()
    if host.startswith("["):  # [::1]:8765
        name = host.partition("]")[0] + "]"
    else:
        name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name in allowed


async def _plain(send: Send, status: int, text: str) -> None:
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), *_HEADERS],
        }
    )
    await send({"type": "http.response.body", "body": body})


def own_origin(request: Request) -> str:
    return f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"


def cross_site_problem(request: Request, trusted_origins: Iterable[str] = ()) -> str | None:
    """Why this mutation may come from another site, or None when it comes from the dashboard's own pages.

    ``Sec-Fetch-Site`` is set by every current browser and cannot be forged by
    a page, so ``same-origin`` settles it. ``Origin`` covers older browsers
    (the pages' ``same-origin`` referrer policy keeps it a real origin, where
    ``no-referrer`` would make it ``null``). A request with neither did not
    come from a browser form of ours, and a mutation is too costly to guess.
    """
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    if site is not None and site not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {site})"
    if site == "same-origin":
        return None
    if origin is not None:
        if origin == own_origin(request) or origin in set(trusted_origins):
            return None
        return "cross-site request refused (Origin does not match this dashboard)"
    if site is not None:
        return None
    return "request refused: it states no Origin or Sec-Fetch-Site, so it may come from another site"


def token_auth(token: str) -> Auth:
    """The auth hook behind ``--auth-token``: HTTP Basic (any user name, the token as password) or Bearer.

    Basic lets a browser ask once and remember; Bearer suits scripts. Every
    action is allowed to whoever has the token: finer rules need an ``auth``
    callable of your own. Compared in constant time.
    """
    if not token:
        raise ValueError("an auth token must not be empty")
    expected = token.encode()

    def check(request: Request, action: Action) -> bool:
        presented = _presented_secret(request.headers.get("authorization", ""))
        return presented is not None and hmac.compare_digest(presented, expected)

    return check


def _presented_secret(header: str) -> bytes | None:
    scheme, _, value = header.partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value.encode()
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return decoded.partition(b":")[2]
    return None


def basic_user(request: Request) -> str | None:
    """The user name a browser sent with Basic auth, to name the actor of an action."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value.strip(), validate=True).partition(b":")[0].decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return user or None
