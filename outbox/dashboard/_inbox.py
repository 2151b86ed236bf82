"""The Inbox page: the dead letters consumers gave up on, one of them in full, and requeueing it.

Reads and acts only through :mod:`outbox.ops`, as ``outbox inbox dead`` and
``outbox inbox requeue`` do: payload and headers are masked the same way, and a
requeue records the same actor and reason. Requeueing asks ``auth`` for the
``requeue`` action, the same permission as requeueing an outbox message, and
goes through the same checks as every action (POST only, same origin, refused
when the dashboard is read-only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import ops
from .._tables import INBOX_DEAD_STATUSES
from ._actions import action
from ._forms import BadInput, text_param, whole
from ._pages import readable
from ._settings import render, settings_of

__all__ = ["ROUTES"]

#: The status filter's choices: one of the statuses, or every one.
STATUS_CHOICES = (*INBOX_DEAD_STATUSES, "any")


def _dead_letter_id(value: str) -> int:
    return whole("dead letter id", value)


def _query(params: Mapping[str, str]) -> dict[str, Any]:
    """The list's filters as given: ``consumer``, ``status`` (default ``dead``), ``before_id``."""
    consumer = text_param("consumer", (params.get("consumer") or "").strip())
    status = (params.get("status") or "dead").strip()
    if status not in STATUS_CHOICES:
        raise BadInput(f"status: one of {', '.join(STATUS_CHOICES)}, got {status[:40]!r}")
    before = (params.get("before_id") or "").strip()
    return {
        "consumer": consumer,
        "status": status,
        "before_id": whole("before_id", before) if before else None,
    }


def _url(query: dict[str, Any], **changes: Any) -> str:
    """The list with these filters: the default status and empty fields left out, so a bookmark reads well."""
    values = {**query, **changes}
    pairs = [(k, str(v)) for k, v in values.items() if v not in (None, "") and (k, v) != ("status", "dead")]
    return "/inbox" + (f"?{urlencode(pairs)}" if pairs else "")


def _listing(engine: Any, query: dict[str, Any], page_size: int, secrets: tuple[str, ...]) -> dict[str, Any]:
    status = None if query["status"] == "any" else query["status"]
    consumer = query["consumer"] or None
    letters = ops.inbox_dead_letters(
        engine,
        consumer=consumer,
        status=status,
        limit=min(page_size, ops.MAX_DEAD_LETTERS) + 1,
        before_id=query["before_id"],
        secrets=secrets,
    )
    more = len(letters) > page_size
    letters = letters[:page_size]
    count = ops.count_inbox_dead_letters(engine, consumer=consumer, status=status)
    # What on-call looks for first: how many wait for a decision (the default filter's count).
    waiting = count if status == "dead" else ops.count_inbox_dead_letters(engine, consumer=consumer)
    return {
        "letters": letters,
        "next_url": _url(query, before_id=letters[-1].id) if more else None,
        "count": count,
        "waiting": waiting,
    }


@readable
async def inbox(request: Request) -> Response:
    settings = settings_of(request)
    query = _query(request.query_params)
    data = await run_in_threadpool(_listing, settings.engine, query, settings.page_size, settings.secrets)
    return render(
        request,
        "inbox.html",
        page="inbox",
        query=query,
        statuses=STATUS_CHOICES,
        self_url=_url(query),
        first_url=_url(query, before_id=None) if query["before_id"] else None,
        **data,
    )


@readable
async def dead_letter(request: Request) -> Response:
    settings = settings_of(request)
    dead_id = _dead_letter_id(request.path_params["id"])
    letter = await run_in_threadpool(
        lambda: ops.inbox_dead_letter(settings.engine, dead_id, secrets=settings.secrets)
    )
    return render(request, "inbox_letter.html", page="inbox", letter=letter)


@action("requeue")
async def requeue(request: Request, form: FormData) -> Response:
    settings = settings_of(request)
    dead_id = _dead_letter_id(request.path_params["id"])
    reason = str(form.get("reason") or "").strip()
    if not reason:
        raise BadInput("a reason is required: it is recorded on the dead letter")
    text_param("reason", reason)
    actor = settings.actor_of(request)
    await run_in_threadpool(
        lambda: ops.requeue_inbox_dead_letter(settings.engine, dead_id, actor=actor, reason=reason)
    )
    root = request.scope.get("root_path", "").rstrip("/")
    return RedirectResponse(f"{root}/inbox/{dead_id}", status_code=303)


ROUTES = [
    Route("/inbox", inbox, name="inbox"),
    Route("/inbox/{id}", dead_letter, name="inbox_dead_letter"),
    Route("/inbox/{id}/requeue", requeue, methods=["POST"]),
]
