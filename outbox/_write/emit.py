"""emit(): validate now, buffer in the session, store with the caller's commit."""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from .. import signals
from .._exceptions import ConfigurationError, EmitError, InvalidEmitOption, UnroutedEvent
from .._routes import Route, check_name, check_priority
from .._topic import is_topic_pattern
from .._tracing import emit_headers
from .install import outbox_for, write_late
from .keys import KEY_LIMIT, KeyTemplate, check_payload_ids, fill_key
from .payload import check_headers, route_document, serialise_payload, text_problem
from .pending import PendingEvent, events_of, innermost
from .rows import AGGREGATE_LIMIT, aggregate_identity

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

__all__ = ["emit"]

#: The longest key or group key text accepted before placeholders are filled in.
_WRITTEN_LIMIT = 4 * KEY_LIMIT
#: Far enough for any reminder; beyond it timestamps overflow (year 9999) and rows become unreadable.
MAX_DELAY = timedelta(days=3650)
#: Events with an idempotency key get a deterministic id, so emitting the same
#: key again returns the id of the event that is (or will be) stored.
_KEYED_EVENT_NAMESPACE = uuid.UUID("6f1c2a52-3b7e-4e0e-9f0e-0a6f5d0c7b1e")


def _check_key(name: str, value: Any) -> str | None:
    """A string worth storing; its placeholders and length are judged by ``fill_key``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidEmitOption(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidEmitOption(f"{name} must not be empty; pass None for no {name}")
    if len(value) > _WRITTEN_LIMIT:  # no template that long can fit the column: spare the parser
        raise InvalidEmitOption(f"{name} must be at most {KEY_LIMIT} characters, got {len(value)}")
    problem = text_problem(value)
    if problem:
        raise InvalidEmitOption(f"{name} {problem}")
    return value


def _check_delay(delay: Any) -> timedelta:
    if delay is None:
        return timedelta(0)
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, int | float) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise InvalidEmitOption(
            f"delay must be a timedelta or a number of seconds, got {type(delay).__name__}"
        )
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidEmitOption(f"delay must be zero or more seconds, got {delay!r}")
    if seconds > MAX_DELAY.total_seconds():
        raise InvalidEmitOption(
            f"delay must be at most {MAX_DELAY.days} days, got {delay!r}; schedule far-off work elsewhere"
        )
    return timedelta(seconds=seconds)


def _check_expiry(expires_at: Any, wait: timedelta, routes: Sequence[Route]) -> datetime | None:
    """``expires_at`` in UTC; refuses one that is naive, already past, or reached before the message is due.

    A message that can only ever expire is a mistake better raised now than
    discarded quietly later: so is a ``delay`` that reaches a route's
    ``expires_after``. Past and due are judged by this host's clock; the
    relay judges expiry by the database's.
    """
    for route in routes:
        if route.expires_after is not None and wait >= route.expires_after:
            raise InvalidEmitOption(
                f"delay {wait} is not shorter than route {route.name!r}'s expires_after "
                f"({route.expires_after}): its message would expire before it is due"
            )
    if expires_at is None:
        return None
    if not isinstance(expires_at, datetime):
        raise InvalidEmitOption(f"expires_at must be an aware datetime, got {type(expires_at).__name__}")
    if expires_at.tzinfo is None or expires_at.utcoffset() is None:
        raise InvalidEmitOption(
            f"expires_at must be an aware datetime, got the naive {expires_at.isoformat()}: "
            "pass one with a tzinfo, e.g. datetime.now(UTC) + timedelta(hours=2)"
        )
    try:
        when = expires_at.astimezone(UTC)
    except OverflowError:
        raise InvalidEmitOption(f"expires_at {expires_at.isoformat()} is not a time UTC can hold") from None
    now = datetime.now(UTC)
    if when <= now:
        raise InvalidEmitOption(
            f"expires_at {when.isoformat()} is already past (now {now.isoformat()}): "
            "the message would never be sent"
        )
    if wait and when <= now + wait:
        raise InvalidEmitOption(
            f"expires_at {when.isoformat()} comes before the message is due (delay {wait}): "
            "it would expire before it is sent"
        )
    return when


def _check_queue(queue: Any) -> str | None:
    if queue is None:
        return None
    try:  # the same rule as route and relay queue names, or a relay could never be told to serve it
        return check_name("queue", queue)
    except ConfigurationError as exc:
        raise InvalidEmitOption(str(exc)) from None


def _check_aggregate(aggregate: Any) -> tuple[str, str | None]:
    """The aggregate type to store and the id if known; refuses a type or known id the columns cannot hold.

    An id the database has not assigned yet (None) is checked when the event is written.
    """
    aggregate_type = getattr(type(aggregate), "__outbox_aggregate_type__", None) or type(aggregate).__name__
    if not isinstance(aggregate_type, str) or len(aggregate_type) > AGGREGATE_LIMIT:
        raise EmitError(
            f"__outbox_aggregate_type__ of {type(aggregate).__name__} must be a string of at most "
            f"{AGGREGATE_LIMIT} characters, got {aggregate_type!r:.80}"
        )
    problem = text_problem(aggregate_type)
    if problem:
        raise EmitError(f"__outbox_aggregate_type__ of {type(aggregate).__name__} {problem}")
    # Raises EmitError now, while the transaction is intact.
    return aggregate_type, aggregate_identity(aggregate)


def _sync(session: Session | AsyncSession) -> Session:
    # Duck-typed so applications without greenlet never import sqlalchemy.ext.asyncio.
    if isinstance(session, Session):
        return session
    sync_session = getattr(session, "sync_session", None)
    if isinstance(sync_session, Session):
        return sync_session
    raise TypeError(f"emit() needs a Session or AsyncSession, got {type(session).__name__}")


def emit(
    session: Session | AsyncSession,
    event_type: str,
    payload: Any,
    *,
    key: str | None = None,
    group_key: str | None = None,
    delay: float | timedelta | None = None,
    headers: dict[str, str] | None = None,
    priority: int | None = None,
    queue: str | None = None,
    expires_at: datetime | None = None,
    _aggregate: Any = None,
) -> uuid.UUID:
    """Record ``event_type`` in the session's transaction; return the event's id.

    One ``outbox_message`` row per route subscribed to ``event_type`` is stored
    if and only if the transaction (and every enclosing savepoint) commits.
    Everything is validated here, before anything is buffered, so a refused
    event leaves the transaction usable.

    ``expires_at`` (an aware datetime): no relay hands the event to a handler
    from then on. Each route's message keeps the earlier of it and its
    route's ``expires_after`` from the time the row is stored.

    ``key`` and ``group_key`` may hold ``{event_type}``, and from an
    ``OutboxMixin`` object ``{aggregate_type}`` and ``{aggregate_id}`` (filled
    when the row is written if the id is not assigned yet; see ``keys``). A
    route that already holds the key stores nothing: announced after the
    commit by ``signals.event_deduplicated`` (see ``dedupe``).
    """
    sync_session = _sync(session)
    outbox = outbox_for(sync_session, session)
    if sync_session.twophase:
        raise ConfigurationError(
            "emit() cannot be used in a two-phase (twophase=True) session: PostgreSQL refuses "
            "PREPARE TRANSACTION after the outbox's NOTIFY, and SQLite has no two-phase commit"
        )
    if not isinstance(event_type, str) or not event_type:
        raise InvalidEmitOption(f"event_type must be a non-empty string, got {event_type!r}")
    routes = outbox.routes_for(event_type)
    if not routes:
        if is_topic_pattern(event_type):
            raise InvalidEmitOption(
                f"event_type {event_type!r} is a pattern ('*' and '#' words are wildcards): "
                "routes subscribe to patterns, an emit names one event type"
            )
        raise UnroutedEvent(event_type, outbox.event_types)
    key = _check_key("key", key)
    group_key = _check_key("group_key", group_key)
    wait = _check_delay(delay)
    expires = _check_expiry(expires_at, wait, routes)
    queue = _check_queue(queue)
    if priority is not None:
        check_priority(priority, "priority", InvalidEmitOption)
    header_map = check_headers(headers)
    if outbox.trace_context:  # the emitting trace, stored with the event (a no-op without [otel])
        header_map = emit_headers(header_map, baggage=outbox.trace_baggage)
    document = serialise_payload(
        payload, outbox.payload_limit, outbox.payload_depth_limit, outbox.json_default
    )

    aggregate_type, aggregate_id = (None, None) if _aggregate is None else _check_aggregate(_aggregate)
    stored_key: str | KeyTemplate | None = key
    stored_group: str | KeyTemplate | None = group_key
    waits_for_id = False
    if key is not None or group_key is not None:
        fill = {
            "event_type": event_type,
            "aggregate": _aggregate,
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
        }
        stored_key = fill_key("key", key, **fill)
        stored_group = fill_key("group_key", group_key, **fill)
        waits_for_id = isinstance(stored_key, KeyTemplate) or isinstance(stored_group, KeyTemplate)
    if aggregate_type is not None and aggregate_id is None:
        check_payload_ids(document, _aggregate, aggregate_type)
    # A key names the event, so the same key gives the same id; one still waiting for the
    # aggregate's id cannot, and gets a random one as an unkeyed event does.
    event_id = (
        uuid.uuid5(_KEYED_EVENT_NAMESPACE, f"{event_type}\n{stored_key}")
        if isinstance(stored_key, str)
        else uuid.uuid4()
    )
    rows = [
        {
            "event_id": event_id,
            "event_type": event_type,
            "handler": route.name,
            "queue": queue or route.queue,
            "priority": route.priority if priority is None else priority,
            # The checked JSON text, not the caller's (mutable) object; shaped per route if it says so.
            "payload": document
            if route.validator is None and route.transform is None
            else route_document(
                route,
                event_type,
                payload,
                document,
                outbox.payload_limit,
                outbox.payload_depth_limit,
                outbox.json_default,
            ),
            "headers": header_map,
            "aggregate_type": aggregate_type,
            "aggregate_id": None,
            "idempotency_key": stored_key,
            "group_key": stored_group,
            "max_attempts": route.max_attempts,
            "delay": wait,
            # The stored expires_at is the earlier of these, from the time the row is written.
            "expires_given": expires,
            "expires_after": route.expires_after,
        }
        for route in routes
    ]
    state = events_of(sync_session)
    assert state is not None
    transaction = sync_session.get_transaction()
    if transaction is not None and not transaction.is_active:
        raise InvalidEmitOption(
            f"{event_type!r} was emitted in a transaction that has ended or failed (in an "
            "after_commit or after_rollback listener, or after a failed flush or commit), where "
            "it can no longer be stored atomically; emit it in a new transaction"
        )
    pending = PendingEvent(
        outbox=outbox,
        event_id=event_id,
        rows=rows,
        aggregate=_aggregate,
        tag=innermost(sync_session),
        waits_for_id=waits_for_id,
    )
    state.add(pending)
    if state.commit_written:
        # Emitted by a before_commit listener that runs after the Outbox's: the
        # commit's write is done, so write this one now, or it would be lost.
        try:
            write_late(sync_session)
        except BaseException:
            state.discard(pending)  # refused: as if never emitted
            raise
    if signals.event_emitted.receivers:
        signals.event_emitted.send(
            outbox,
            session=sync_session,
            event_id=event_id,
            event_type=event_type,
            routes=tuple(route.name for route in routes),
        )
    return event_id
