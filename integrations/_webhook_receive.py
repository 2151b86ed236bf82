"""Receiving Standard Webhooks exactly once: verify the signature, then dedupe by ``webhook-id`` in an inbox.

A webhook sender delivers at least once: an answer lost after the receiver
committed, a retry, an operator's requeue or resend all send the same
``webhook-id`` again (``WebhookHandler`` keeps it for the event and route,
see ``webhook_id()``). :func:`receive` turns each request into an
:class:`~outbox.InboxMessage` whose id is the ``webhook-id`` and hands it to
:meth:`Inbox.process <outbox.Inbox.process>`, so the marker and the
handlers' effects commit together and a repeat changes nothing.

The steps, in the order that keeps them safe:

1. the settings (inbox, sessions, secret, ...) are checked before the
   request is looked at, so a bad secret fails the first call, whatever came;
2. the signature, on the raw body: an unauthentic request writes nothing;
3. the body as JSON and its event type (the ``event_type`` the receiver was
   given, one endpoint per type, else the body's ``"type"``, the Standard
   Webhooks payload ``{"type", "timestamp", "data"}``); a body the receiver
   can never take writes nothing either, and the sender records the refusal;
4. ``inbox.process`` (``aprocess``): marker and handlers in one transaction.

The answer (:class:`WebhookReceipt`) tells the sender what to do next:

=====  ======================================================================
200    handled, duplicate, unhandled, or dead (a dead letter recorded in the
       receiver's inbox): all final, the sender must stop
400    the body is not JSON, has no event type, or its id or type cannot be
       stored: sending it again cannot help; nothing stored
401    missing, malformed, stale or wrong signature: nothing stored
500    a handler failed: nothing stored, send it again
503    the receiver's database failed: nothing stored, send it again
=====  ======================================================================

Reasons name errors by type only: they go back to the sender, and the
secret never appears in them or in the log lines.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, TypeAlias, cast

from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import sessionmaker

from outbox import ConfigurationError, HandlerFailed, Inbox, InboxMessage, InvalidInboxMessage, Processed
from outbox._first_line import first_line
from outbox._inbox.checks import check_text
from outbox._inbox.dead import error_name
from outbox._inbox.sessions import AsyncSessions, Sessions
from outbox._redact import _SECRET_KEY

from ._signing import SupportsItems, WebhookVerificationError, _lowered, parse_secrets, verify

__all__ = ["WebhookReceipt", "WebhookReceiver", "areceive", "receive"]

log = logging.getLogger("outbox.integrations.webhook")

Headers: TypeAlias = SupportsItems | Iterable[tuple[str, str]]
_Kind: TypeAlias = Literal["sync", "async", "either"]

#: What ``InboxMessage.source`` says unless the receiver names its own.
DEFAULT_SOURCE = "webhook"
#: Never stored with the message: the signature is of no use once checked.
_SIGNATURE = "webhook-signature"
#: Errors that become an answer; anything else is a bug or bad set-up, and is raised. A handler's own
#: errors arrive as HandlerFailed, so an OSError here is the database connection's: asyncpg raises
#: ConnectionRefusedError and TimeoutError as they are, where SQLAlchemy wraps other drivers' errors.
_ANSWERED = (HandlerFailed, InvalidInboxMessage, DBAPIError, PoolTimeout, OSError)


@dataclass(frozen=True, slots=True)
class WebhookReceipt:
    """What to answer the sender, and why.

    ``status_code``: 200 when the outcome is final (``processed`` says which:
    handled, duplicate, unhandled, dead), 400 for a body that can never be
    taken, 401 for a failed verification, 500 when a handler failed, 503 when
    the database did; nothing is stored for any but 200. ``reason`` is a short
    text safe to send back as the body. ``error`` is the exception behind a
    4xx or 5xx, for the receiver's own logs, never for the answer.
    """

    status_code: int
    processed: Processed | None
    reason: str
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Settings:
    inbox: Inbox
    sessions: Any
    kind: _Kind
    secret: str | tuple[str, ...] = field(repr=False)  # never shown, should the settings be printed
    event_type: str | None
    tolerance: float
    source: str


def _kind_of(sessions: object) -> _Kind | None:
    """Which of ``receive``/``areceive`` the sessions suit; None if they make no sessions at all."""
    # Only an application that imported SQLAlchemy's asyncio extension can hold its objects.
    extension = sys.modules.get("sqlalchemy.ext.asyncio")
    if extension is not None and isinstance(sessions, extension.AsyncEngine | extension.async_sessionmaker):
        return "async"
    if isinstance(sessions, Engine | sessionmaker):
        return "sync"
    return "either" if callable(sessions) else None


def _configure(
    what: str,
    inbox: object,
    sessions: object,
    secret: object,
    event_type: object,
    tolerance: object,
    source: object,
) -> _Settings:
    """The settings, each checked, or a one-line ConfigurationError naming what to fix (never a secret)."""
    if not isinstance(inbox, Inbox):
        raise ConfigurationError(f"{what} takes an outbox.Inbox first, got {type(inbox).__name__}")
    kind = _kind_of(sessions)
    if kind is None:
        raise ConfigurationError(
            f"{what} takes a sessionmaker or an Engine (async_sessionmaker or AsyncEngine for the "
            f"async calls), got {type(sessions).__name__}"
        )
    if secret is None or secret == "":
        raise ConfigurationError(
            f"{what} needs secret='whsec_...' (or a list of them): the sender's signing secret"
        )
    parse_secrets(cast("str | Sequence[str]", secret))  # its errors name a secret by position, never by value
    secrets = secret if isinstance(secret, str) else tuple(cast("Sequence[str]", secret))  # a copy: fixed
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not math.isfinite(tolerance):
        raise ConfigurationError(f"tolerance must be a number of seconds, got {tolerance!r}")
    if tolerance <= 0:
        raise ConfigurationError(f"tolerance must be > 0 seconds, got {tolerance!r}")
    try:
        checked_type = check_text("event_type", event_type, required=False)
        checked_source = check_text("source", source, required=True)
    except InvalidInboxMessage as exc:
        raise ConfigurationError(str(exc)) from None
    return _Settings(
        inbox,
        sessions,
        kind,
        secrets,
        checked_type,
        float(tolerance),
        checked_source or DEFAULT_SOURCE,
    )


def _expect(settings: _Settings, kind: Literal["sync", "async"], call: str, other: str) -> None:
    if settings.kind not in (kind, "either"):
        made = "async" if kind == "sync" else "sync"
        raise ConfigurationError(f"{call} needs {kind} sessions, and these are {made}: use {other}")


def _refused(
    status: int, reason: str, error: BaseException, action: str, message_id: str | None, why: str = ""
) -> WebhookReceipt:
    """A 4xx or 5xx receipt, logged at WARNING (``why``: more than the sender is told, if anything)."""
    log.warning(
        "webhook %s answered %d: %s",
        "request" if message_id is None else repr(message_id),
        status,
        why or reason,
        extra={"action": action, "message_id": message_id, "status": status},
    )
    return WebhookReceipt(status, None, reason, error)


def _event_type(settings: _Settings, payload: Any) -> str | None:
    if settings.event_type is not None:
        return settings.event_type
    named = payload.get("type") if isinstance(payload, dict) else None
    return named if isinstance(named, str) and named else None


def _stored_headers(found: dict[str, str]) -> dict[str, str]:
    """The request's headers as the inbox keeps them: no signature, nothing that may be a credential."""
    return {k: v for k, v in found.items() if k != _SIGNATURE and not _SECRET_KEY.search(k)}


def _message(settings: _Settings, body: bytes, headers: Headers) -> InboxMessage | WebhookReceipt:
    """The verified request as an InboxMessage, or the 400 or 401 that refuses it."""
    try:
        verify(body, headers, settings.secret, tolerance=settings.tolerance)
    except WebhookVerificationError as exc:
        return _refused(401, f"webhook verification failed: {exc}", exc, "webhook_refused", None)
    found = _lowered(headers)
    message_id = found["webhook-id"]
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        reason = f"the body is not JSON: {type(exc).__name__}: {first_line(exc)}"
        return _refused(400, reason, exc, "webhook_rejected", message_id)
    event_type = _event_type(settings, payload)
    if event_type is None:
        reason = (
            "no event type: the body has no 'type' string (Standard Webhooks' "
            '{"type", "timestamp", "data"}) and this endpoint names none'
        )
        return _refused(400, reason, InvalidInboxMessage(reason), "webhook_rejected", message_id)
    return InboxMessage(
        message_id,
        event_type,
        payload,
        _stored_headers(found),
        settings.source,
        datetime.fromtimestamp(int(found["webhook-timestamp"].strip()), UTC),  # verified digits
    )


def _answer(processed: Processed) -> WebhookReceipt:
    if processed.outcome == "dead":
        kind = "" if processed.error is None else f" ({error_name(processed.error)})"
        reason = f"recorded as a dead letter{kind} in the receiver's inbox; do not send it again"
    else:
        reason = {
            "handled": "handled",
            "duplicate": "duplicate: received before, nothing done again",
            "unhandled": "no handler takes this event type; skipped",
        }[processed.outcome]
    return WebhookReceipt(200, processed, reason)


def _failed(message: InboxMessage, error: BaseException) -> WebhookReceipt:
    if isinstance(error, HandlerFailed):
        cause = "" if error.__cause__ is None else f" ({type(error.__cause__).__name__})"
        where = f"handler {error.handler!r}" if error.handler else "writing the handlers' changes"
        reason = f"{where} failed{cause}; nothing stored, send it again"
        return _refused(500, reason, error, "webhook_handler_failed", message.id, first_line(error))
    if isinstance(error, InvalidInboxMessage):
        reason = f"the message cannot be stored: {first_line(error)}"
        return _refused(400, reason, error, "webhook_rejected", message.id)
    # The database's own error: first_line keeps its statement and parameters out of the log.
    log.error(
        "webhook %r: database error, answered 503: %s: %s",
        message.id,
        type(error).__name__,
        first_line(error),
        extra={"action": "webhook_database_error", "message_id": message.id, "status": 503},
    )
    reason = f"database error ({type(error).__name__}); nothing stored, send it again"
    return WebhookReceipt(503, None, reason, error)


def _receive(settings: _Settings, body: bytes, headers: Headers) -> WebhookReceipt:
    message = _message(settings, body, headers)
    if isinstance(message, WebhookReceipt):
        return message
    try:
        processed = settings.inbox.process(settings.sessions, message)
    except _ANSWERED as error:
        return _failed(message, error)
    return _answer(processed)


async def _areceive(settings: _Settings, body: bytes, headers: Headers) -> WebhookReceipt:
    message = _message(settings, body, headers)
    if isinstance(message, WebhookReceipt):
        return message
    try:
        processed = await settings.inbox.aprocess(settings.sessions, message)
    except _ANSWERED as error:
        return _failed(message, error)
    return _answer(processed)


def receive(
    inbox: Inbox,
    sessions: Sessions,
    *,
    body: bytes,
    headers: Headers,
    secret: str | Sequence[str],
    event_type: str | None = None,
    tolerance: float = 300,
    source: str = DEFAULT_SOURCE,
) -> WebhookReceipt:
    """Verify one webhook request and take it once through ``inbox``; what to answer the sender.

    ``body`` is the raw request body, ``headers`` the request's (any mapping
    or list of pairs; names are case-insensitive), ``secret`` the sender's
    ``whsec_...`` secret or a list of them (rotation). ``event_type`` names
    the type of every message this endpoint receives; without it the body's
    ``"type"`` says. ``tolerance`` is how far, in seconds, ``webhook-timestamp``
    may be from now. ``source`` is stored with the marker. Handlers get an
    :class:`~outbox.InboxMessage` whose ``id`` is the ``webhook-id``,
    ``payload`` the parsed body, ``headers`` the request's (without the
    signature and credentials) and ``sent_at`` the ``webhook-timestamp``.

    Returns a :class:`WebhookReceipt` for every request; raises only for bad
    settings (``ConfigurationError``, before the request is looked at) and
    bugs.
    """
    settings = _configure("receive()", inbox, sessions, secret, event_type, tolerance, source)
    _expect(settings, "sync", "receive()", "await areceive(...)")
    return _receive(settings, body, headers)


async def areceive(
    inbox: Inbox,
    sessions: AsyncSessions,
    *,
    body: bytes,
    headers: Headers,
    secret: str | Sequence[str],
    event_type: str | None = None,
    tolerance: float = 300,
    source: str = DEFAULT_SOURCE,
) -> WebhookReceipt:
    """:func:`receive` with an ``async_sessionmaker`` or ``AsyncEngine``, through ``inbox.aprocess``."""
    settings = _configure("areceive()", inbox, sessions, secret, event_type, tolerance, source)
    _expect(settings, "async", "areceive()", "receive(...)")
    return await _areceive(settings, body, headers)


class WebhookReceiver:
    """:func:`receive` with its settings given once, and checked at construction.

    ::

        orders = WebhookReceiver(inbox, Session, secret=SECRET, event_type="order.paid")

        receipt = orders.receive(request.get_data(), request.headers)          # Flask
        receipt = await orders.areceive(await request.body(), request.headers)  # FastAPI

    :meth:`receive` takes a ``sessionmaker`` or ``Engine``, :meth:`areceive`
    an ``async_sessionmaker`` or ``AsyncEngine``.
    """

    def __init__(
        self,
        inbox: Inbox,
        sessions: Sessions | AsyncSessions,
        *,
        secret: str | Sequence[str],
        event_type: str | None = None,
        tolerance: float = 300,
        source: str = DEFAULT_SOURCE,
    ) -> None:
        self._settings = _configure("WebhookReceiver", inbox, sessions, secret, event_type, tolerance, source)

    @property
    def inbox(self) -> Inbox:
        return self._settings.inbox

    @property
    def event_type(self) -> str | None:
        return self._settings.event_type

    def __repr__(self) -> str:
        taken = self._settings.event_type or "the body's type"
        return f"<WebhookReceiver {self._settings.inbox.name!r} {taken}>"

    def receive(self, body: bytes, headers: Headers) -> WebhookReceipt:
        """Verify and take one request; see :func:`receive`."""
        _expect(self._settings, "sync", "WebhookReceiver.receive()", "await receiver.areceive(...)")
        return _receive(self._settings, body, headers)

    async def areceive(self, body: bytes, headers: Headers) -> WebhookReceipt:
        """Verify and take one request with async sessions; see :func:`receive`."""
        _expect(self._settings, "async", "WebhookReceiver.areceive()", "receiver.receive(...)")
        return await _areceive(self._settings, body, headers)
