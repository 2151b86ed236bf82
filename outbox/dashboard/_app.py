"""``create_app``: the routes, their settings, the security middleware."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .._hosts import host_name
from .._urls import sync_engine
from . import _actions, _events, _inbox, _live, _pages
from ._format import FILTERS
from ._overview import finished_counts, unfinished_counts
from ._security import Auth, SecurityHeaders
from ._settings import Settings, render

__all__ = ["create_app"]


def create_app(
    engine: Any,
    *,
    auth: Auth | None = None,
    allow_actions: bool = False,
    secrets: Iterable[str] = (),
    actor: Callable[[Request], str] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    trusted_origins: Sequence[str] = (),
    page_size: int = 50,
    count_cap: int = 1_000,
    bulk_cap: int = 1_000,
    poll_interval: float = 1.0,
    finished_max_age: float = 30.0,
) -> Starlette:
    """The dashboard as an ASGI app, to mount under any path or serve alone.

    ``engine``: an Engine, an AsyncEngine or a URL. ``auth(request, action)``
    (sync or async) decides each request; ``action`` is one of ``read``,
    ``requeue``, ``resend``, ``discard``, ``pause``, ``retry``. Without ``allow_actions``
    the dashboard is read-only whatever ``auth`` says. ``secrets`` are values
    and field names masked wherever a payload or header is shown, on top of
    the field names masked always (password, token, secret...).
    ``allowed_hosts`` limits the ``Host`` header (against DNS rebinding; set it
    when the app has no auth): names or IP addresses, matched exactly, on any
    port. ``trusted_origins`` are extra origins allowed to
    post (a proxy that rewrites ``Host``). ``count_cap`` bounds list counts,
    ``bulk_cap`` how many messages one bulk action may touch. Delivered and
    discarded totals (a full count) are refreshed in the background at most
    every ``finished_max_age`` seconds; everything else is read per request.
    """
    for name, value in (("page_size", page_size), ("count_cap", count_cap), ("bulk_cap", bulk_cap)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    for name, seconds in (("poll_interval", poll_interval), ("finished_max_age", finished_max_age)):
        if seconds <= 0:
            raise ValueError(f"{name} must be positive, got {seconds}")
    hosts = None if allowed_hosts is None else _checked_hosts(allowed_hosts)
    sync = sync_engine(engine)
    unfinished = unfinished_counts(sync, max_age=1.0)
    templates = Environment(
        loader=PackageLoader("outbox.dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    templates.filters.update(FILTERS)
    settings = Settings(
        engine=sync,
        auth=auth,
        allow_actions=allow_actions,
        secrets=tuple(secrets),
        trusted_origins=tuple(trusted_origins),
        actor=actor,
        page_size=page_size,
        count_cap=count_cap,
        bulk_cap=bulk_cap,
        poll_interval=poll_interval,
        templates=templates,
        feed=_live.ChangeFeed(sync, poll_interval, on_change=unfinished.refresh),
        finished=finished_counts(sync, finished_max_age),
        unfinished=unfinished,
    )
    routes = [
        *_pages.ROUTES,
        *_actions.ROUTES,
        *_inbox.ROUTES,
        Route("/events", _events.events),
        Mount("/static", app=StaticFiles(packages=[("outbox.dashboard", "static")]), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[Middleware(SecurityHeaders, allowed_hosts=hosts)],
        exception_handlers={404: _not_found, 405: _not_allowed},
    )
    app.state.outbox = settings
    return app


def _checked_hosts(allowed_hosts: Sequence[str]) -> list[str]:
    """Each name as a Host header would carry it; one that no header could match is a mistake, said now."""
    if isinstance(allowed_hosts, str):  # a lone name would be read letter by letter
        raise ValueError(f"allowed_hosts is a list of host names: allowed_hosts=[{allowed_hosts!r}]")
    try:
        return [host_name(name) for name in allowed_hosts]
    except ValueError as exc:
        raise ValueError(f"allowed_hosts: {exc}") from None


async def _not_found(request: Request, exc: Exception) -> Response:
    return render(request, "error.html", 404, title="Not found", problem=getattr(exc, "detail", "Not found"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return render(request, "error.html", 405, title="Method not allowed", problem="Actions are POST only.")
