"""The read-only pages: overview, messages, one message, dead letters, queues and handlers, reports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from .. import ops
from .._tables import MESSAGE_STATUSES
from ._forms import (
    FILTER_FIELDS,
    BadInput,
    ListQuery,
    dead_query,
    message_id,
    parse_list_query,
    text_param,
)
from ._overview import Cached, overview_data
from ._settings import render, settings_of

__all__ = ["ROUTES", "allowed_to_read", "readable"]

Endpoint = Callable[[Request], Awaitable[Response]]


async def allowed_to_read(request: Request) -> Response | None:
    """None when ``auth`` lets this request read; else a 401 that makes a browser ask for credentials."""
    if await settings_of(request).allowed(request, "read"):
        return None
    response = render(
        request, "error.html", 401, title="Sign in", problem="This dashboard needs credentials."
    )
    response.headers["www-authenticate"] = 'Basic realm="outbox dashboard", charset="UTF-8"'
    return response


def readable(endpoint: Endpoint) -> Endpoint:
    """Every page asks ``auth`` for ``read`` first; bad input and unknown ids get their own pages."""

    @wraps(endpoint)
    async def checked(request: Request) -> Response:
        refusal = await allowed_to_read(request)
        if refusal is not None:
            return refusal
        try:
            return await endpoint(request)
        except BadInput as exc:
            return render(request, "error.html", 400, title="Bad request", problem=str(exc))
        except ops.NotFound as exc:
            return render(request, "error.html", 404, title="Not found", problem=str(exc))

    return checked


@readable
async def overview(request: Request) -> Response:
    settings = settings_of(request)
    data = await run_in_threadpool(overview_data, settings.engine, settings.unfinished, settings.finished)
    return render(request, "overview.html", page="overview", live=True, **data)


def _listing(engine: Any, query: ListQuery, cap: int) -> dict[str, Any]:
    rows = ops.list_messages(engine, query.where, limit=query.limit + 1, before_id=query.before_id)
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    # The first page holding every match gives the count for free. Otherwise counting can
    # read far more rows than the page shows (a filter that matches sparsely, or one no
    # index serves), so the page comes at once and the count is its own request
    # (``/messages/count``), which the page's script fetches and a link offers without it.
    exact = query.before_id is None and not more and len(rows) <= cap
    count = ops.CappedCount(count=len(rows), capped=False) if exact else None
    return {"rows": rows, "more": more, "count": count}


@readable
async def count(request: Request) -> Response:
    """How many messages a list's filter matches, up to the cap: a page of its own, fetched by the list."""
    settings = settings_of(request)
    page = "dead" if request.url.path.rstrip("/").endswith("/dead/count") else "messages"
    if page == "dead":
        query = dead_query(request.query_params, page_size=settings.page_size)
    else:
        query = parse_list_query(request.query_params, page_size=settings.page_size)
    found = await run_in_threadpool(
        lambda: ops.count_messages(settings.engine, query.where, cap=settings.count_cap)
    )
    return render(
        request, "count.html", page=page, count=found, cap=settings.count_cap, list_url=query.url(f"/{page}")
    )


async def _list_page(request: Request, template: str, page: str, query: ListQuery) -> HTMLResponse:
    settings = settings_of(request)
    data = await run_in_threadpool(_listing, settings.engine, query, settings.count_cap)
    path = f"/{page}"
    next_url = query.url(path, before_id=data["rows"][-1].id) if data["more"] else None
    return render(
        request,
        template,
        page=page,
        live=page == "messages",
        query=query,
        base_path=path,
        fields=FILTER_FIELDS,
        statuses=MESSAGE_STATUSES,
        next_url=next_url,
        first_url=query.url(path, before_id=None) if query.before_id else None,
        count_url=query.url(f"{path}/count", before_id=None),
        self_url=query.url(path),
        cap=settings.count_cap,
        bulk_cap=settings.bulk_cap,
        # The dead-letter page's switch: the same filters, with or without the requeued originals.
        needing_url=query.url(path, needs_decision=""),
        all_dead_url=query.url(path, needs_decision="0"),
        **data,
    )


@readable
async def messages(request: Request) -> Response:
    query = parse_list_query(request.query_params, page_size=settings_of(request).page_size)
    return await _list_page(request, "messages.html", "messages", query)


@readable
async def dead_letters(request: Request) -> Response:
    query = dead_query(request.query_params, page_size=settings_of(request).page_size)
    return await _list_page(request, "dead.html", "dead", query)


def _detail(engine: Any, mid: int, secrets: tuple[str, ...]) -> dict[str, Any]:
    history = ops.show(engine, mid, secrets=secrets)
    return {"history": history, "lineage": ops.lineage(engine, mid)}


@readable
async def message(request: Request) -> Response:
    settings = settings_of(request)
    mid = message_id(request.path_params["id"])
    data = await run_in_threadpool(_detail, settings.engine, mid, settings.secrets)
    msg = data["history"].message
    headers = msg.get("headers") or {}
    trace = headers.get("traceparent") if isinstance(headers, dict) else None
    return render(request, "message.html", page="messages", msg=msg, trace=trace, **data)


def _queues_data(engine: Any, unfinished: Cached, finished: Cached) -> dict[str, Any]:
    cells = unfinished.get()[0] + finished.get()[0]
    queues: dict[str, dict[str, int]] = {}
    handlers: dict[str, dict[str, int]] = {}
    for cell in cells:
        queues.setdefault(cell.queue, {})[cell.status] = (
            queues.get(cell.queue, {}).get(cell.status, 0) + cell.count
        )
        handlers.setdefault(cell.handler, {})[cell.status] = (
            handlers.get(cell.handler, {}).get(cell.status, 0) + cell.count
        )
    paused = {(p.kind, p.name): p for p in ops.paused(engine)}
    for kind, name in paused:  # a paused name no message has used yet still shows, to be resumed
        (queues if kind == "queue" else handlers).setdefault(name, {})
    relays = ops.relays(engine)
    limits: dict[str, dict[str, Any]] = {}
    for relay in relays:
        if not relay.alive:
            continue
        for handler, state in relay.handlers.items():
            seen = limits.setdefault(handler, {"rate_limit": None, "breakers": {}})
            if state.rate_limit is not None:
                seen["rate_limit"] = state.rate_limit
            for destination, is_open in state.breakers.items():
                seen["breakers"][destination] = seen["breakers"].get(destination, False) or bool(is_open)
    return {
        "queues": dict(sorted(queues.items())),
        "handlers": dict(sorted(handlers.items())),
        "paused": paused,
        "limits": limits,
    }


@readable
async def queues(request: Request) -> Response:
    settings = settings_of(request)
    data = await run_in_threadpool(_queues_data, settings.engine, settings.unfinished, settings.finished)
    return render(request, "queues.html", page="queues", live=True, statuses=MESSAGE_STATUSES, **data)


@readable
async def reports(request: Request) -> Response:
    before = text_param("before", request.query_params.get("before") or "") or None
    runs = await run_in_threadpool(ops.report_runs, settings_of(request).engine, limit=50, before=before)
    return render(request, "reports.html", page="reports", live=True, runs=runs)


@readable
async def report(request: Request) -> Response:
    run_id = text_param("report run id", request.path_params["run_id"])
    detail = await run_in_threadpool(ops.report_run, settings_of(request).engine, run_id)
    return render(request, "report.html", page="reports", detail=detail)


ROUTES = [
    Route("/", overview, name="overview"),
    Route("/messages", messages, name="messages"),
    Route("/messages/count", count, name="messages_count"),
    Route("/dead/count", count, name="dead_count"),
    Route("/messages/{id}", message, name="message"),
    Route("/dead", dead_letters, name="dead"),
    Route("/queues", queues, name="queues"),
    Route("/reports", reports, name="reports"),
    Route("/reports/{run_id}", report, name="report"),
]
