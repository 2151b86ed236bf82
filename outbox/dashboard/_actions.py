"""The actions: requeue, resend, discard, retry now, pause, resume. POST only, same-origin, each authorised.

Each calls the same :mod:`outbox.ops` function as the ``outbox`` command, so
the history row (actor, reason) is the same whichever tool acted. A bulk
action asks first, stating the count, then acts on exactly the ids it
counted: a message that dies between the question and the answer is not
swept in unseen.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from .. import ops
from ._forms import BadInput, dead_query, id_list, message_id, reason_and_ids, text_param
from ._security import Action, cross_site_problem
from ._settings import render, settings_of

__all__ = ["ROUTES"]

Handler = Callable[[Request, FormData], Awaitable[Response]]
MAX_FORM_FIELDS = 5000


def action(name: Action) -> Callable[[Handler], Callable[[Request], Awaitable[Response]]]:
    def decorate(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        @wraps(handler)
        async def checked(request: Request) -> Response:
            settings = settings_of(request)
            problem = cross_site_problem(request, settings.trusted_origins)
            if problem is not None:
                return render(request, "error.html", 403, title="Refused", problem=problem)
            if not settings.allow_actions:
                return render(
                    request, "error.html", 403, title="Read-only", problem="This dashboard is read-only."
                )
            if not await settings.allowed(request, name):
                return render(
                    request, "error.html", 403, title="Refused", problem=f"You may not {name} here."
                )
            try:
                form = await request.form(max_fields=MAX_FORM_FIELDS)
                return await handler(request, form)
            except BadInput as exc:
                return render(request, "error.html", 400, title="Bad request", problem=str(exc))
            except ops.InvalidRequest as exc:
                return render(request, "error.html", 400, title="Bad request", problem=str(exc))
            except ops.NotFound as exc:
                return render(request, "error.html", 404, title="Not found", problem=str(exc))
            except ops.OpsError as exc:
                return render(request, "error.html", 409, title="Not done", problem=str(exc))

        return checked

    return decorate


def _back(request: Request, path: str) -> RedirectResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    return RedirectResponse(root + path, status_code=303)


def _one(request: Request, form: FormData) -> tuple[Any, dict[str, Any]]:
    """The engine, and the arguments every single-message action takes: this id, the reason, the actor."""
    settings = settings_of(request)
    reason, _ = reason_and_ids(form, [])
    named = ops.MessageFilter(ids=(message_id(request.path_params["id"]),))
    return settings.engine, {"where": named, "reason": reason, "actor": settings.actor_of(request)}


@action("requeue")
async def requeue_one(request: Request, form: FormData) -> Response:
    engine, args = _one(request, form)
    pairs = await run_in_threadpool(lambda: ops.requeue(engine, **args))
    return _back(request, f"/messages/{pairs[0][1]}")


@action("resend")
async def resend_one(request: Request, form: FormData) -> Response:
    engine, args = _one(request, form)
    pairs = await run_in_threadpool(lambda: ops.resend(engine, **args))
    return _back(request, f"/messages/{pairs[0][1]}")


@action("discard")
async def discard_one(request: Request, form: FormData) -> Response:
    engine, args = _one(request, form)
    await run_in_threadpool(lambda: ops.discard(engine, **args))
    return _back(request, f"/messages/{args['where'].ids[0]}")


@action("retry")
async def retry_one(request: Request, form: FormData) -> Response:
    engine, args = _one(request, form)
    await run_in_threadpool(lambda: ops.retry_now(engine, **args, include_delayed=True))
    return _back(request, f"/messages/{args['where'].ids[0]}")


async def _bulk(request: Request, form: FormData, verb: str) -> Response:
    settings = settings_of(request)
    reason, chosen = reason_and_ids(form, [str(i) for i in form.getlist("id")])
    query = dead_query(form, page_size=settings.page_size)  # type: ignore[arg-type]
    confirmed = form.get("confirm")
    if form.get("scope") == "filter":  # the radio wins over boxes left ticked; a confirmation has no scope
        where = query.where
    elif chosen:
        where = ops.MessageFilter(ids=tuple(chosen), status="dead")
    else:
        raise BadInput("select messages, or choose to act on every message the filter matches")
    ids = await run_in_threadpool(
        lambda: ops.candidate_ids(settings.engine, where, verb, limit=settings.bulk_cap + 1)
    )
    context: dict[str, Any] = {"page": "dead", "verb": verb, "reason": reason, "query": query}
    if len(ids) > settings.bulk_cap:
        raise BadInput(
            f"more than {settings.bulk_cap:,} messages match; narrow the filter, "
            f"or use `outbox {verb}` for larger batches"
        )
    if not ids:
        return render(request, "done.html", verb=verb, done=[], nothing=True, **context)
    expected = id_list("expected_ids", str(form.get("expected_ids") or ""))
    if confirmed != "yes" or sorted(expected) != ids:
        changed = confirmed == "yes"
        return render(request, "confirm.html", ids=ids, changed=changed, **context)
    actor = settings.actor_of(request)
    named = ops.MessageFilter(ids=tuple(ids))
    if verb == "requeue":
        pairs = await run_in_threadpool(
            lambda: ops.requeue(settings.engine, named, reason=reason, actor=actor)
        )
        return render(request, "done.html", done=pairs, **context)
    discarded = await run_in_threadpool(
        lambda: ops.discard(settings.engine, named, reason=reason, actor=actor)
    )
    return render(request, "done.html", done=[(i, None) for i in discarded], **context)


@action("requeue")
async def requeue_many(request: Request, form: FormData) -> Response:
    return await _bulk(request, form, "requeue")


@action("discard")
async def discard_many(request: Request, form: FormData) -> Response:
    return await _bulk(request, form, "discard")


def _target(form: FormData) -> dict[str, str]:
    kind = form.get("kind")
    name = text_param("name", str(form.get("name") or "").strip())
    if kind not in ("queue", "handler"):
        raise BadInput("kind: queue or handler")
    if not name:
        raise BadInput(f"name the {kind} to pause or resume")
    return {str(kind): name}


async def _pause_or_resume(request: Request, form: FormData, change: Any) -> Response:
    settings = settings_of(request)
    target = _target(form)
    reason, _ = reason_and_ids(form, [])
    actor = settings.actor_of(request)
    await run_in_threadpool(lambda: change(settings.engine, reason=reason, actor=actor, **target))
    return _back(request, "/queues")


@action("pause")
async def pause(request: Request, form: FormData) -> Response:
    return await _pause_or_resume(request, form, ops.pause)


@action("pause")
async def resume(request: Request, form: FormData) -> Response:
    return await _pause_or_resume(request, form, ops.resume)


ROUTES = [
    Route("/messages/{id}/requeue", requeue_one, methods=["POST"]),
    Route("/messages/{id}/resend", resend_one, methods=["POST"]),
    Route("/messages/{id}/discard", discard_one, methods=["POST"]),
    Route("/messages/{id}/retry", retry_one, methods=["POST"]),
    Route("/dead/requeue", requeue_many, methods=["POST"]),
    Route("/dead/discard", discard_many, methods=["POST"]),
    Route("/queues/pause", pause, methods=["POST"]),
    Route("/queues/resume", resume, methods=["POST"]),
]
