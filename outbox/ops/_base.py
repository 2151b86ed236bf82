"""What every operation shares: the errors, the clock, durations, the checks on actor and reason."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Column, ColumnElement, Table, Text, cast, func, insert, select
from sqlalchemy.engine import Connection, Row

from .._exceptions import OutboxError
from .._redact import TOO_DEEP
from .._tables import outbox_attempt, outbox_message

m = outbox_message
a = outbox_attempt

REQUEUABLE = ("dead", "discarded")
#: Finished messages a receiver may have lost: never dead ones (requeue's) nor unfinished ones.
RESENDABLE = ("delivered", "discarded")
DISCARDABLE = ("pending", "dead")
#: The idempotency_key column's width.
KEY_LIMIT = 255
#: The width of every history table's actor column: a longer actor is refused, never cut.
ACTOR_LIMIT = 255
#: Messages a filter-based requeue or discard reads, locks and changes per transaction.
ACTION_BATCH = 500


class OpsError(OutboxError):
    """An operation was asked for something it must refuse (wrong status, bad filter, bad duration)."""


class NotFound(OpsError):
    """No message has the given id."""


class InvalidRequest(OpsError, ValueError):
    """The request itself is malformed (no reason, a bad duration or filter): unchanged, it can never work.

    Apart from the other refusals (a message in the wrong status, a change that
    raced another), which depend on the outbox's state at the moment, so that
    the dashboard can answer 400 for these and 409 for those.
    """


#: The largest id an outbox table can hold (BIGINT); larger numbers are refused before any query.
MAX_ID = 2**63 - 1


def utc_time(text: str) -> datetime:
    """An ISO date or time as stored: UTC when no zone is given, converted to UTC otherwise.

    Raises ``ValueError`` for text that is not ISO and ``OverflowError`` for a
    time with no UTC equivalent (0001-01-01T00:00+01:00); each caller words
    the refusal its own way (a command-line flag, a query parameter).
    """
    parsed = datetime.fromisoformat(text)
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def as_text(table: Table, *documents: str) -> list[Column[Any] | ColumnElement[Any]]:
    """Every column of ``table``, in order, with the named JSON ones read as their text (see ``decoded``)."""
    return [cast(c, Text).label(c.name) if c.name in documents else c for c in table.c]


def decoded(document: str | None) -> Any:
    """A stored JSON document read as text, decoded; ``TOO_DEEP`` in its place if it nests too deeply.

    Left to the driver, a document too deep for the json module (written before
    emit() capped nesting, or by another writer) would fail the whole read.
    """
    if document is None:
        return None
    try:
        return json.loads(document)
    except RecursionError:
        return TOO_DEEP


def _now() -> datetime:
    return datetime.now(UTC)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` → timedelta; anything else is refused."""
    match = _DURATION.match(text)
    if not match:
        raise InvalidRequest(f"bad duration {text!r}: use a number and one of s, m, h, d, w (e.g. 30d)")
    try:
        return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    except (OverflowError, ValueError):  # past timedelta's 999,999,999 days, or inf
        raise InvalidRequest(f"duration {text!r} is too long: at most 999999999d") from None


def _before(now: datetime, age: timedelta, what: str) -> datetime:
    """``now - age``, refused in one line when it would fall before year 1."""
    try:
        return now - age
    except OverflowError:
        raise InvalidRequest(f"{what} {age.days}d reaches back before year 1; give a shorter age") from None


def _has_copy() -> ColumnElement[bool]:
    """True for an ``outbox_message`` row that a requeued copy points at (ix_outbox_message_requeued_from)."""
    copy = m.alias("requeued_copy")
    return select(copy.c.id).where(copy.c.requeued_from == m.c.id).exists()


def _needs_decision() -> list[ColumnElement[bool]]:
    """Dead with no requeued copy: what ``stats().dead`` counts and an operator still has to decide on.

    A discarded message is decided by its status; a requeued original stays
    ``dead`` for the record, so only the copy pointing back at it tells.
    """
    return [m.c.status == "dead", ~_has_copy()]


def _copy_id() -> ColumnElement[int]:
    """The id of the copy a requeue made of an ``outbox_message`` row, or NULL.

    One lookup in ix_outbox_message_requeued_from per row. A message is copied
    at most once; ``min`` keeps the value single all the same.
    """
    copy = m.alias("requeued_as")
    return select(func.min(copy.c.id)).where(copy.c.requeued_from == m.c.id).scalar_subquery()


def _record_action(
    conn: Connection, old: Row[Any], outcome: str, actor: str, reason: str, now: datetime, **detail: Any
) -> None:
    """SQLite: an operator's action as a history row on the message it acted on.

    History keeps one row per message, attempt, outcome and time (``outbox_0008``
    skips a repeat silently): a second row for the same action on the same
    message at the same instant, which only a clock too coarse to tell two
    resends apart could produce, refuses the action rather than go unrecorded.
    """
    written = conn.execute(
        insert(a).values(
            message_id=old.id,
            attempt=old.attempts,
            outcome=outcome,
            started_at=now,
            finished_at=now,
            duration_ms=0,
            actor=actor,
            reason=reason,
            detail={**detail, "previous_status": old.status},
        )
    ).rowcount
    if written != 1:
        raise OpsError(f"message {old.id} has a {outcome} row of this very instant already; try again")


def _check_reason(reason: str, actor: str) -> None:
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidRequest("a reason is required: it is what the audit trail will say")
    if not isinstance(actor, str) or not actor.strip():
        raise InvalidRequest("an actor is required")
    if len(actor) > ACTOR_LIMIT:  # PostgreSQL would refuse the history row mid-action; SQLite would keep it
        raise InvalidRequest(f"the actor is longer than {ACTOR_LIMIT} characters; give a shorter name")


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequest(f"batch_size must be a whole number of at least 1, got {batch_size!r}")
