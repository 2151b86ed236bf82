"""Query strings and forms into ``ops`` arguments, refusing bad input with a message a person can act on.

List filters are named like the ``outbox list`` flags (``status``, ``queue``,
``handler``, ``event_type``, ``where``, ``needs_decision``...), so a URL reads
like a command line and a bookmark is a saved query.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from starlette.datastructures import ImmutableMultiDict

from .. import ops
from .._tables import MESSAGE_STATUSES
from ..ops._base import MAX_ID, utc_time

__all__ = [
    "FILTER_FIELDS",
    "BadInput",
    "ListQuery",
    "dead_query",
    "id_list",
    "message_id",
    "parse_list_query",
    "reason_and_ids",
    "text_param",
    "whole",
]

#: Query parameter, label: the list filters, in the order the form shows them.
FILTER_FIELDS: tuple[tuple[str, str], ...] = (
    ("status", "Status"),
    ("queue", "Queue"),
    ("handler", "Handler"),
    ("event_type", "Event type"),
    ("aggregate_type", "Aggregate type"),
    ("aggregate_id", "Aggregate id"),
    ("key", "Idempotency key"),
    ("group_key", "Group key"),
    ("since", "Created since"),
    ("before", "Created before"),
)
_TEXT_FIELDS = ("queue", "handler", "event_type", "aggregate_type", "aggregate_id", "key", "group_key")
MAX_TEXT = 1000
#: ASCII digits only: ``str.isdigit`` and ``int`` also take ``²`` or ``٣``, which are no id a page links to.
_DIGITS = re.compile(r"[0-9]+")


class BadInput(ValueError):
    """A parameter the dashboard cannot use; its message names the parameter and says what is expected."""


@dataclass(frozen=True)
class ListQuery:
    where: ops.MessageFilter
    values: dict[str, str]  # the filters as given, to refill the form
    wheres: list[str]
    before_id: int | None
    limit: int

    def url(self, path: str, **changes: Any) -> str:
        """This query with some parameters changed (``""`` drops one): pagination links, bookmarks."""
        pairs: list[tuple[str, str]] = [(k, v) for k, v in self.values.items() if v]
        pairs += [("where", w) for w in self.wheres]
        extra = {k: v for k, v in changes.items() if v is not None}
        pairs = [(k, v) for k, v in pairs if k not in extra]
        pairs += [(k, str(v)) for k, v in extra.items() if v != ""]
        return f"{path}?{urlencode(pairs)}" if pairs else path

    @property
    def hidden_fields(self) -> list[tuple[str, str]]:
        """The filter as form fields, so a bulk action posts exactly what the page showed."""
        pairs = [(k, v) for k, v in self.values.items() if v]
        return pairs + [("where", w) for w in self.wheres]


def text_param(name: str, value: str) -> str:
    """Text that goes into a query as given; NUL is refused here, since PostgreSQL refuses it mid-query."""
    if len(value) > MAX_TEXT:
        raise BadInput(f"{name} is longer than {MAX_TEXT} characters")
    if "\x00" in value:
        raise BadInput(f"{name} contains a NUL character")
    return value


def _time(name: str, value: str) -> datetime:
    try:
        return utc_time(value.strip())
    except OverflowError:
        raise BadInput(f"{name}: {value!r} is out of range once converted to UTC") from None
    except ValueError:
        raise BadInput(f"{name}: expected an ISO date or time (2026-12-01T10:00), got {value!r}") from None


def whole(name: str, value: str, *, low: int = 1, high: int = MAX_ID) -> int:
    digits = value.strip()
    if not _DIGITS.fullmatch(digits):
        raise BadInput(f"{name}: expected a whole number, got {value[:40]!r}")
    if len(digits.lstrip("0")) > len(str(high)):  # before int(): 5,000 digits would hit Python's own limit
        raise BadInput(f"{name}: expected {low} to {high}, got a {len(digits)}-digit number")
    number = int(digits)
    if not low <= number <= high:
        raise BadInput(f"{name}: expected {low} to {high}, got {number}")
    return number


def message_id(value: str) -> int:
    return whole("message id", value)


def id_list(name: str, value: str) -> list[int]:
    """Comma-separated message ids, as a confirmation page writes them; empty items are skipped."""
    return [whole(name, item) for item in value.split(",") if item.strip()]


def _needs_decision(value: str, default: bool) -> bool:
    if not value:
        return default
    if value not in ("0", "1"):
        raise BadInput(f"needs_decision: 1 (only dead messages nobody has requeued) or 0, got {value[:40]!r}")
    return value == "1"


def parse_list_query(
    params: Mapping[str, str] | ImmutableMultiDict[str, str],
    *,
    page_size: int,
    status: str | None = None,
    needs_decision: bool = False,
) -> ListQuery:
    """``status`` forces one status (the dead-letter page) whatever the query says.

    ``needs_decision`` is what the query means without a ``needs_decision``
    parameter; only a value that differs from it is kept in the query's URLs.
    """
    get = params.get
    multi = params.getlist("where") if isinstance(params, ImmutableMultiDict) else []
    values = {name: (get(name) or "").strip() for name, _ in FILTER_FIELDS}
    if status is not None:
        values["status"] = status
    if values["status"] and values["status"] not in MESSAGE_STATUSES:
        raise BadInput(f"status: one of {', '.join(MESSAGE_STATUSES)}, got {values['status']!r}")
    deciding = _needs_decision((get("needs_decision") or "").strip(), needs_decision)
    if deciding and values["status"] not in ("", "dead"):
        raise BadInput(
            f"needs_decision: only dead messages need a decision; status={values['status']} matches none"
        )
    values["needs_decision"] = "" if deciding == needs_decision else str(int(deciding))
    texts = {name: text_param(name, values[name]) or None for name in _TEXT_FIELDS}
    wheres = [text_param("where", w.strip()) for w in multi if w.strip()]
    try:
        payload = tuple(ops.parse_where(w) for w in wheres)
    except ops.WhereError as exc:
        raise BadInput(f"where: {exc}") from None
    limit_text = get("limit")
    before_text = get("before_id")
    where = ops.MessageFilter(
        status=values["status"] or None,
        created_since=_time("since", values["since"]) if values["since"] else None,
        created_before=_time("before", values["before"]) if values["before"] else None,
        payload=payload,
        queue=texts["queue"],
        handler=texts["handler"],
        event_type=texts["event_type"],
        aggregate_type=texts["aggregate_type"],
        aggregate_id=texts["aggregate_id"],
        key=texts["key"],
        group_key=texts["group_key"],
        needs_decision=deciding,
    )
    return ListQuery(
        where=where,
        values=values,
        wheres=wheres,
        before_id=whole("before_id", before_text) if before_text else None,
        limit=whole("limit", limit_text, high=500) if limit_text else page_size,
    )


def dead_query(params: Mapping[str, str] | ImmutableMultiDict[str, str], *, page_size: int) -> ListQuery:
    """The dead-letter page's query: dead messages, only those needing a decision unless ``needs_decision=0``.

    The page, its count and its bulk actions all read it here, so an action by
    filter touches what the page listed.
    """
    return parse_list_query(params, page_size=page_size, status="dead", needs_decision=True)


def reason_and_ids(form: Mapping[str, Any], ids: Sequence[str]) -> tuple[str, list[int]]:
    reason = str(form.get("reason") or "").strip()
    if not reason:
        raise BadInput("a reason is required: it is written to each message's history")
    text_param("reason", reason)
    return reason, [message_id(i) for i in ids]
