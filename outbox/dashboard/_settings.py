"""What every page shares: the app's settings, the auth decision, rendering a template."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Environment
from sqlalchemy.engine import Engine
from starlette.requests import Request
from starlette.responses import HTMLResponse

from .._write.payload import text_problem
from ..ops._base import ACTOR_LIMIT
from ._forms import BadInput
from ._live import ChangeFeed
from ._overview import Cached
from ._security import Action, Auth, basic_user

__all__ = ["Settings", "render", "settings_of"]


@dataclass
class Settings:
    engine: Engine
    auth: Auth | None
    allow_actions: bool
    secrets: tuple[str, ...]
    trusted_origins: tuple[str, ...]
    actor: Callable[[Request], str] | None
    page_size: int
    count_cap: int
    bulk_cap: int
    poll_interval: float
    templates: Environment = field(repr=False)
    feed: ChangeFeed = field(repr=False)
    finished: Cached = field(repr=False)
    unfinished: Cached = field(repr=False)

    async def allowed(self, request: Request, action: Action) -> bool:
        if action != "read" and not self.allow_actions:
            return False
        if self.auth is None:
            return True
        verdict = self.auth(request, action)
        if inspect.isawaitable(verdict):
            verdict = await verdict
        return bool(verdict)

    def actor_of(self, request: Request) -> str:
        """Who did it, as the history records it: the app's answer, else the login the request carries.

        A name the history cannot record is refused here, before any action
        starts: a login comes from the browser, so it may be any length or
        hold a NUL, which PostgreSQL would only refuse mid-action.
        """
        actor = self._actor(request)
        if len(actor) > ACTOR_LIMIT:
            raise BadInput(
                f"the actor name {actor[:40]!r}... is longer than {ACTOR_LIMIT} characters, the most the"
                " history records: sign in with a shorter user name"
            )
        problem = text_problem(actor)
        if problem:
            raise BadInput(f"the actor name {actor[:40]!r} {problem}: sign in with another user name")
        return actor

    def _actor(self, request: Request) -> str:
        if self.actor is not None:
            return self.actor(request)
        user = request.scope.get("user")
        name = getattr(user, "display_name", None) if getattr(user, "is_authenticated", False) else None
        name = name or basic_user(request)
        return f"dashboard:{name}" if name else "dashboard"


def settings_of(request: Request) -> Settings:
    settings: Settings = request.app.state.outbox
    return settings


def render(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    settings = settings_of(request)
    page = settings.templates.get_template(template).render(
        request=request,
        root=request.scope.get("root_path", "").rstrip("/"),
        allow_actions=settings.allow_actions,
        **context,
    )
    return HTMLResponse(page, status_code=status_code)
